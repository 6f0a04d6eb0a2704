"""An EAGLE-3 drafter's decode step against its target's, on this machine (issue 61's bar: at most 0.2).

    OMP_NUM_THREADS=1 python benchmarks/eagle3_cost.py [--drafter runs/eagle3/drafter] [--draft-vocab-size 8192]

Both read one new token over a KV cache of `context` positions: the target's whole forward (30 layers and the LM
head over its 49 152 tokens), the drafter's fc fusion of three target states, its decoder layer and its LM head over
the draft vocabulary (a trained folder, or a fresh drafter of that vocabulary: the cost is the shape's, not the
weights'). Prints the median milliseconds of each and their ratio. Both run on prepacked linear layers unless
`--packed-weights false` (`specheads.pair.packed`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specheads.pair.drafters import fill_from_target, vocab_maps
from specheads.pair.eagle3 import build_drafter, default_layer_ids, drafter_forward, load_drafter
from specheads.pair.models import ModelSpec, load_model
from specheads.pair.packed import pack_linear_weights
from specheads.plumbing.dataclass_cli import parse_script


@dataclass
class CostBenchmark:
    """What to time.

    Args:
        drafter: a trained drafter folder (speculators' format); none: a fresh drafter of `draft_vocab_size`.
        draft_vocab_size: the fresh drafter's vocabulary.
        target: the target model.
        context: positions already in both caches.
        repeats: timed steps (after 5 untimed).
        packed_weights: both models' linear layers on weights prepacked once (`specheads.pair.packed`), as
            benchmarks/eagle3_decode.py runs them.
    """

    drafter: str | None = None
    draft_vocab_size: int = 8192
    target: str = "embedded:smollm2"
    context: int = 200
    repeats: int = 60
    packed_weights: bool = True


def median_seconds(step: Callable[[], None], repeats: int) -> float:
    """The median wall time of `step` over `repeats` calls, after 5 untimed ones."""
    for _ in range(5):
        step()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


@torch.no_grad()
def main() -> None:
    from transformers import DynamicCache

    args = parse_script(CostBenchmark, "eagle3_cost.py", "An EAGLE-3 drafter's decode step against its target's.")
    target = load_model(ModelSpec(path=args.target))
    if args.drafter:
        drafter = load_drafter(args.drafter, target)
    else:
        counts = torch.arange(target.config.vocab_size, 0, -1)
        drafter = build_drafter(target.config, default_layer_ids(target.config.num_hidden_layers), args.draft_vocab_size, "none")
        fill_from_target(drafter, target, *vocab_maps(counts, args.draft_vocab_size)).eval()
    for model in (target, drafter) if args.packed_weights else ():
        pack_linear_weights(model)
    torch.manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, args.context))
    features = torch.randn(1, args.context, 3 * target.config.hidden_size)
    target_cache, draft_cache = DynamicCache(config=target.config), DynamicCache()

    def draft_forward(tokens: torch.Tensor, fused: torch.Tensor, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + tokens.shape[1]).unsqueeze(0)
        normed, _ = drafter_forward(drafter, tokens, drafter.fc(fused), None, positions, draft_cache)
        return drafter.lm_head(normed)

    target(input_ids=ids, past_key_values=target_cache, use_cache=True)
    draft_forward(ids, features, 0)

    def target_step() -> None:
        target(input_ids=ids[:, :1], past_key_values=target_cache, use_cache=True)
        target_cache.crop(-1)

    def draft_step() -> None:
        draft_forward(ids[:, :1], features[:, :1], args.context)
        draft_cache.crop(-1)

    target_seconds = median_seconds(target_step, args.repeats)
    draft_seconds = median_seconds(draft_step, args.repeats)
    print(f"target {target_seconds * 1e3:.2f} ms, drafter {draft_seconds * 1e3:.2f} ms (vocabulary "
          f"{drafter.config.draft_vocab_size}), ratio {draft_seconds / target_seconds:.3f}, context {args.context}, "
          f"{torch.get_num_threads()} thread(s), {'prepacked' if args.packed_weights else 'stock'} linear layers")


if __name__ == "__main__":
    main()
