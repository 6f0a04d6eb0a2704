"""Wall clock of an EAGLE-3 drafter against the target alone at B = 1 (issue 61), and its acceptance per position.

    OMP_NUM_THREADS=1 python benchmarks/eagle3_decode.py --drafter runs/eagle3/drafter --prompts 20 --ks "[2, 3, 4]"

On the held-out confirmation prompts (never trained on: the drafter trains on the built-in ones), each prompt is
decoded by the target alone (one cached forward a token) and by `specheads.decoding.eagle3.eagle3_decode` at each
constant K, with the same seed; prints tokens/s of each, the speedup as a ratio of summed times, mean tokens per
round and the acceptance per drafted position, and writes them as JSON with `--out`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from specheads.dataset.prompts import encode_prompt, load_prompts
from specheads.decoding.eagle3 import eagle3_decode
from specheads.decoding.sampler import draw
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.eagle3 import load_drafter
from specheads.pair.models import ModelSpec, load_model, load_tokenizer, stop_token_ids
from specheads.plumbing.dataclass_cli import parse_script
from specheads.plumbing.files import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class DecodeBenchmark:
    """What to decode.

    Args:
        drafter: the drafter folder (speculators' format).
        target: the target model.
        prompt_file: JSONL of prompts.
        prompts: how many of them.
        max_new_tokens: tokens per request.
        ks: the constant K settings.
        temperature: the sampling temperature (0: greedy).
        out: a JSON file for the results.
    """

    drafter: str
    target: str = "embedded:smollm2"
    prompt_file: str = str(ROOT / "benchmarks" / "prompts" / "heldout_confirm.jsonl")
    prompts: int = 20
    max_new_tokens: int = 64
    ks: list[int] = field(default_factory=lambda: [2, 3, 4])
    temperature: float = 1.0
    out: str | None = None


@torch.no_grad()
def target_alone(target: torch.nn.Module, prompt: list[int], transform: SamplingTransform, max_new_tokens: int, seed: int,
                 stops: set[int]) -> tuple[list[int], float]:
    """The target's own decoding, one cached forward a token: (tokens, seconds)."""
    began = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=target.config)
    logits = target(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
    tokens: list[int] = []
    while True:
        tokens.append(draw(transform.log_probs(logits.float()), generator))
        if len(tokens) >= max_new_tokens or tokens[-1] in stops:
            return tokens, time.perf_counter() - began
        logits = target(input_ids=torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True).logits[0, -1]


def main() -> None:
    args = parse_script(DecodeBenchmark, "eagle3_decode.py", "An EAGLE-3 drafter against the target alone at B = 1.")
    spec = ModelSpec(path=args.target)
    tokenizer, target = load_tokenizer(spec), load_model(spec)
    drafter = load_drafter(args.drafter, target)
    stops = set(stop_token_ids(target, tokenizer))
    transform = SamplingTransform(args.temperature)
    prompts = [encode_prompt(tokenizer, prompt) for prompt in load_prompts(args.prompt_file, limit=args.prompts)]
    alone = [target_alone(target, prompt, transform, args.max_new_tokens, seed, stops) for seed, prompt in enumerate(prompts)]
    alone_tokens, alone_seconds = sum(len(t) for t, _ in alone), sum(s for _, s in alone)
    report = {"prompts": len(prompts), "target_alone_tokens_per_s": alone_tokens / alone_seconds, "settings": {}}
    print(f"target alone: {alone_tokens / alone_seconds:.1f} tokens/s ({alone_tokens} tokens)")
    for k in args.ks:
        results = [eagle3_decode(target, drafter, prompt, transform, k, args.max_new_tokens, seed, tuple(stops))
                   for seed, prompt in enumerate(prompts)]
        tokens, seconds = sum(len(r.tokens) for r in results), sum(r.seconds for r in results)
        reached = [sum(r.reached[i] for r in results) for i in range(k)]
        accepted = [sum(r.accepted[i] for r in results) for i in range(k)]
        per_position = [a / n if n else None for a, n in zip(accepted, reached)]
        rounds = sum(r.rounds for r in results)
        setting = {"tokens_per_s": tokens / seconds, "speedup": (tokens / seconds) / (alone_tokens / alone_seconds),
                   "tokens_per_round": (tokens - len(results)) / max(rounds, 1), "acceptance_per_position": per_position}
        report["settings"][f"K={k}"] = setting
        print(f"K={k}: {setting['tokens_per_s']:.1f} tokens/s, {setting['speedup']:.2f}x the target alone, "
              f"{setting['tokens_per_round']:.2f} tokens a round, acceptance per position "
              + " ".join(f"{a:.3f}" for a in per_position if a is not None))
    if args.out:
        write_json_atomic(Path(args.out), report)


if __name__ == "__main__":
    main()
