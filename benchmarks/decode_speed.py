"""Benchmark of eval's decoding runs: the round engine over B rows against B = 1 (issue: batched decoding).

Side by side in one process, on the same held-out prompts, settings and per-prompt seeds: every setting's
runs decoded one prompt at a time (`RoundEngine.decode_one`) and `--batch-size` prompts at a time
(`RoundEngine.decode`). It prints wall time of each, their ratio, and the share of runs
whose tokens are identical (float32: a padded forward can move a logit in its last bits, which flips a draw
only when a uniform lands that close to a threshold).

    python benchmarks/decode_speed.py --prompts 32 --max-new-tokens 64 --head runs/ontime/split0/checkpoints/last.ckpt
"""

from __future__ import annotations

import json
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
        prompts: held-out prompts decoded per setting (from `--prompt-file`).
        prompt_file: JSONL of prompts.
        max_new_tokens: tokens per run.
        max_draft: K_max of the adaptive policies.
        batch_size: prompts the batched loop decodes together.
        constant_ks: constant-K settings.
        confidence: draft-confidence thresholds.
        svip: SVIP thresholds.
        head: a trained stop head (`.ckpt` or head folder); its policy runs at `head_thresholds`.
        head_thresholds: thresholds of the head policy.
        device: cpu or cuda.
        threads: torch CPU threads (0: torch's default).
        out: write the figures as JSON here too.
    """

    prompts: PositiveInt = 32
    prompt_file: str = str(ROOT / "benchmarks" / "prompts" / "heldout_decode.jsonl")
    max_new_tokens: PositiveInt = 64
    max_draft: PositiveInt = 8
    batch_size: PositiveInt = 32
    constant_ks: list[PositiveInt] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])
    confidence: list[float] = field(default_factory=lambda: [0.1, 0.25, 0.45, 0.65])
    svip: list[float] = field(default_factory=lambda: [0.8, 1.1, 1.4, 1.7])
    head: str | None = None
    head_thresholds: list[float] = field(default_factory=lambda: [0.3, 0.5, 0.65, 0.8, 0.9])
    device: str = "cpu"
    threads: int = 0
    out: str | None = None

    def check(self) -> None:
        """Refuse, before any model loads (`parse_script`), a threshold no rule takes (`make_policy`: finite, >= 0)."""
        from specheads.decoding import make_policy

        for name, values in (("confidence", self.confidence), ("svip", self.svip), ("head", self.head_thresholds)):
            for value in values:
                make_policy(name, value, self.max_draft)


def main() -> None:
    from specheads.artifacts.checkpoint import load_trained
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.decoding import RoundEngine, make_policy
    from specheads.model_outputs.sampling import SamplingTransform
    from specheads.pair.models import ModelSpec, load_pair, stop_token_ids
    from specheads.plumbing.dataclass_cli import parse_script

    config = parse_script(Config, "decode_speed.py", __doc__.splitlines()[0])
    if config.threads:
        torch.set_num_threads(config.threads)
    pair = load_pair(ModelSpec(path="embedded:smollm2"), ModelSpec(path=None, skip_layers=[20, 21]))
    device = torch.device(config.device)
    pair.target.to(device)
    pair.draft.to(device)
    head = load_trained(config.head).head.to(device) if config.head else None
    prompts = [encode_prompt(pair.tokenizer, p) for p in load_prompts(config.prompt_file)[: config.prompts]]
    policies = ([make_policy("constant_k", k) for k in config.constant_ks]
                + [make_policy("confidence", t, config.max_draft) for t in config.confidence]
                + [make_policy("svip", t, config.max_draft) for t in config.svip]
                + ([make_policy("head", t, config.max_draft) for t in config.head_thresholds] if head is not None else []))
    decoder = RoundEngine(pair.target, pair.draft, SamplingTransform(1.0), stop_token_ids(pair.target, pair.tokenizer))
    seeds = list(range(len(prompts)))

    start = time.perf_counter()
    batched = [result for policy in policies for first in range(0, len(prompts), config.batch_size)
               for result in decoder.decode(prompts[first : first + config.batch_size], policy, config.max_new_tokens,
                                            seeds[first : first + config.batch_size], head if policy.reads_head else None)]
    batched_s = time.perf_counter() - start
    start = time.perf_counter()
    single = [decoder.decode_one(prompt, policy, config.max_new_tokens, seed, head if policy.reads_head else None)
              for policy in policies for prompt, seed in zip(prompts, seeds)]
    single_s = time.perf_counter() - start
    identical = sum(a.tokens == b.tokens for a, b in zip(batched, single))
    figures = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "threads": torch.get_num_threads(), "prompts": len(prompts), "settings": len(policies),
               "runs": len(single), "max_new_tokens": config.max_new_tokens, "batch_size": config.batch_size,
               "tokens": sum(r.emitted for r in single), "batch_1_s": round(single_s, 1), "batched_s": round(batched_s, 1),
               "speedup": round(single_s / batched_s, 2), "identical_runs": identical}
    print(json.dumps(figures, indent=1))
    if config.out:
        Path(config.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
