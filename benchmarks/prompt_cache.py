"""Benchmark of the prompt cache (`specheads.decoding.prompt_cache`): an eval sweep's settings decoded with and
without it.

Side by side in one process, on the same prompts, settings and per-prompt seeds: every setting decoded `--batch-size`
prompts at a time by a round engine that prefills each prompt for each setting, and by one whose prompt cache keeps
the prompts' keys and values from the first setting on (the first setting fills it). Repeated `--repeats` times in
turn (A B A B ...). Prints each side's wall time per repeat, the median ratio, and the share of runs whose tokens
are identical (float32: a loaded prompt can move a logit in its last bits, which flips a draw only on a near-tie).

    python benchmarks/prompt_cache.py --prompts 40 --max-new-tokens 16 --batch-size 40
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jsonargparse.typing import PositiveInt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Config:
    """What to decode.

    Args:
        prompts: prompts decoded per setting (built-in prompts from number 101 on, which the demo's data never holds).
        max_new_tokens: tokens per run.
        max_draft: K_max of the adaptive rules.
        batch_size: prompts decoded together.
        settings: `[policy, threshold]` pairs, each decoded on every prompt (the demo's rules by default).
        repeats: times each side runs, in turn.
        out: write the figures as JSON here too.
    """

    prompts: PositiveInt = 40
    max_new_tokens: PositiveInt = 16
    max_draft: PositiveInt = 6
    batch_size: PositiveInt = 40
    settings: list[tuple[str, float]] = field(default_factory=lambda: [("constant_k", 3.0), ("confidence", 0.34),
                                                                        ("svip", 1.4383)])
    repeats: PositiveInt = 2
    out: str | None = None


def main() -> None:
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.decoding import RoundEngine, make_policy
    from specheads.decoding.prompt_cache import PromptCache
    from specheads.model_outputs.sampling import SamplingTransform
    from specheads.pair.models import ModelSpec, load_pair, stop_token_ids
    from specheads.plumbing.dataclass_cli import parse_script

    config = parse_script(Config, "prompt_cache.py", __doc__.splitlines()[0])
    pair = load_pair(ModelSpec(path="embedded:smollm2"), ModelSpec(path=None, skip_layers=[20, 21]))
    prompts = [encode_prompt(pair.tokenizer, p) for p in load_prompts("builtin")[100 : 100 + config.prompts]]
    seeds = list(range(len(prompts)))
    stops = stop_token_ids(pair.target, pair.tokenizer)

    def sweep(prompt_cache: PromptCache | None) -> tuple[float, list[list[int]]]:
        engine = RoundEngine(pair.target, pair.draft, SamplingTransform(1.0), stops, prompt_cache=prompt_cache)
        start = time.perf_counter()
        tokens = [result.tokens for name, threshold in config.settings
                  for result in engine.decode(prompts, make_policy(name, threshold, config.max_draft),
                                              config.max_new_tokens, seeds, batch_size=config.batch_size)]
        return time.perf_counter() - start, tokens

    prefilled, cached, identical = [], [], []
    for _ in range(config.repeats):
        seconds, plain = sweep(None)
        prefilled.append(round(seconds, 1))
        seconds, loaded = sweep(PromptCache(2 << 30))
        cached.append(round(seconds, 1))
        identical.append(sum(a == b for a, b in zip(plain, loaded)) / len(plain))
    figures = {"threads": torch.get_num_threads(), "prompts": len(prompts), "settings": config.settings,
               "max_new_tokens": config.max_new_tokens, "batch_size": config.batch_size, "prefilled_s": prefilled,
               "cached_s": cached, "cached_over_prefilled_median": round(statistics.median(
                   c / p for c, p in zip(cached, prefilled)), 2), "identical_runs_share": min(identical)}
    print(json.dumps(figures, indent=1))
    if config.out:
        Path(config.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
