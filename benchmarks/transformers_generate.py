"""An exported head inside transformers' own `generate`, against transformers' assisted generation (issue 35).

On the embedded pair (SmolLM2-135M-Instruct, the draft skips layers 20-21), the same held-out prompts and the same
torch seed per prompt, one after the other in one process:
- `target`: `target.generate(do_sample=True, ...)` alone;
- `assisted`: `generate(assistant_model=draft)` with transformers 5.x defaults (20 assistant tokens, schedule
  `constant`, confidence threshold 0.4 re-tuned by ROC within each call: transformers 5.x tunes a copy of the
  assistant's generation config, so every call starts again from 0.4);
- `heuristic`: the older default (`num_assistant_tokens=5`, schedule `heuristic`, no confidence threshold);
- `head`: `generate(custom_generate=speculative_generate, draft=draft, head=load_head(--head))`.

Forwards are counted by hooks on the two models' decoders (the prompt's prefill included, for every method), tokens up
to and including EOS. One short untimed `generate` runs before the first timed call (a warm-up); generate's prefill
computes the last position's logits only (`logits_to_keep=1`), as the round engine's does. Per method: target and draft
forwards per token, wall-clock tokens/s, and the modelled speedup over the target alone at c = t_draft/t_target from
the counted forwards, tokens / (c · draft forwards + target forwards), with a 95 % paired bootstrap interval over
prompts for the head against each transformers method.

    python benchmarks/transformers_generate.py --head runs/ontime/head --prompts 40 --max-new-tokens 48 --out bench.json
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from jsonargparse.typing import PositiveFloat, PositiveInt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Config:
    """What to compare.

    Args:
        head: an exported stop head (`specheads export --out` folder or Hub id) trained for the embedded pair.
        prompts: held-out prompts (from `--prompt-file`).
        prompt_file: JSONL of prompts none of the head's tuning saw.
        max_new_tokens: tokens per generate call (fewer when EOS comes first).
        cost_ratio: t_draft/t_target of the modelled speedup (0.2 ≈ a 7B draft for a 70B target).
        threads: torch CPU threads (0: torch's default).
        bootstrap: resamples of the prompts for the paired intervals.
        out: write the figures as JSON here too.
    """

    head: str
    prompts: PositiveInt = 40
    prompt_file: str = str(ROOT / "benchmarks" / "prompts" / "heldout_confirm.jsonl")
    max_new_tokens: PositiveInt = 48
    cost_ratio: PositiveFloat = 0.2
    threads: int = 0
    bootstrap: int = 2000
    out: str | None = None


class ForwardCounter:
    """Counts a model's forward passes: a hook on its decoder, which transformers' generate and the round engine
    (which reads a state of the draft's stack) both run once per forward."""

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        model.get_decoder().register_forward_pre_hook(self.hook)

    def hook(self, module: torch.nn.Module, args: tuple) -> None:
        self.count += 1


def paired_interval(mine: np.ndarray, theirs: np.ndarray, resamples: int, seed: int = 0) -> list[float]:
    """95 % interval of Σ tokens / Σ cost (mine) over (theirs) − 1, prompts resampled; rows are (tokens, cost)."""
    draws = np.random.default_rng(seed).integers(0, len(mine), (resamples, len(mine)))
    ratios = (mine[draws, 0].sum(1) / mine[draws, 1].sum(1)) / (theirs[draws, 0].sum(1) / theirs[draws, 1].sum(1)) - 1
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def main() -> None:
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.heads import load_head
    from specheads.integrations.transformers import speculative_generate
    from specheads.pair.models import ModelSpec, load_pair, stop_token_ids
    from specheads.plumbing.dataclass_cli import parse_script

    config = parse_script(Config, "transformers_generate.py", __doc__.splitlines()[0])
    if config.threads:
        torch.set_num_threads(config.threads)
    pair = load_pair(ModelSpec(path="embedded:smollm2"), ModelSpec(path=None, skip_layers=[20, 21]))
    target, draft = pair.target, pair.draft
    eos = stop_token_ids(target, pair.tokenizer)
    head = load_head(config.head)
    prompts = [encode_prompt(pair.tokenizer, p) for p in load_prompts(config.prompt_file)[: config.prompts]]
    counters = {"target": ForwardCounter(target), "draft": ForwardCounter(draft)}
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    common = {"max_new_tokens": config.max_new_tokens, "eos_token_id": eos, "pad_token_id": eos[0], **sampling}

    def assistant(tokens: int, schedule: str, threshold: float) -> dict:
        draft.generation_config.num_assistant_tokens = tokens
        draft.generation_config.num_assistant_tokens_schedule = schedule
        draft.generation_config.assistant_confidence_threshold = threshold
        return {"assistant_model": draft}

    stats: list = []  # the head method's counts per row: its head's forwards, charged at their cost in draft forwards
    methods = {"target": lambda: {}, "assisted": lambda: assistant(20, "constant", 0.4),
               "heuristic": lambda: assistant(5, "heuristic", 0.0),
               "head": lambda: {"custom_generate": speculative_generate, "draft": draft, "head": head, "stats": stats}}
    rows: dict[str, list[tuple[int, int, int, float]]] = {name: [] for name in methods}
    # untimed and uncounted: a first forward allocates and picks kernels, which would fall on the first timed prompt
    target.generate(torch.tensor([prompts[0]]), attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long),
                    **{**common, "max_new_tokens": 2})
    for name, extra in methods.items():
        options = extra()  # once per method; transformers copies the assistant's config per call (state is per call)
        for number, prompt in enumerate(prompts):
            torch.manual_seed(number)
            before = {role: counter.count for role, counter in counters.items()}
            counted = len(stats)
            start = time.perf_counter()
            out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  **common, **options)
            seconds = time.perf_counter() - start
            new = out[0, len(prompt):].tolist()
            ended = next((i + 1 for i, token in enumerate(new) if token in eos), len(new))
            head_forwards = sum(s.head_forwards for s in stats[counted:])
            rows[name].append((ended, counters["target"].count - before["target"],
                               counters["draft"].count - before["draft"] + head_forwards, seconds))
        print(f"{name}: done", file=sys.stderr)
    c = config.cost_ratio
    costs = {name: np.array([(t, tf + c * df) for t, tf, df, _ in runs], dtype=float) for name, runs in rows.items()}
    base = costs["target"][:, 0].sum() / costs["target"][:, 1].sum()
    figures = {"device": "cpu", "threads": torch.get_num_threads(), "prompts": len(prompts),
               "prompt_file": Path(config.prompt_file).name, "max_new_tokens": config.max_new_tokens, "cost_ratio": c,
               "head": config.head, "head_rule": head[1].as_dict(), "methods": {}}
    for name, runs in rows.items():
        tokens = sum(r[0] for r in runs)
        figures["methods"][name] = {
            "tokens": tokens, "target_forwards_per_token": sum(r[1] for r in runs) / tokens,
            "draft_forwards_per_token": sum(r[2] for r in runs) / tokens,
            "wall_tokens_per_s": tokens / sum(r[3] for r in runs),
            "modelled_speedup": (costs[name][:, 0].sum() / costs[name][:, 1].sum()) / base}
    for other in ("assisted", "heuristic"):
        figures["methods"]["head"][f"vs_{other}_ci"] = paired_interval(costs["head"], costs[other], config.bootstrap)
        figures["methods"]["head"][f"vs_{other}"] = (figures["methods"]["head"]["modelled_speedup"]
                                                     / figures["methods"][other]["modelled_speedup"] - 1)
    print(json.dumps(figures, indent=1))
    if config.out:
        Path(config.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
