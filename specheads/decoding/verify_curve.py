"""A target's verify curve at B = 1 on this machine: one request's forward time against the tokens in it, on top of a
cached prompt, the shape of a round that verifies k proposed tokens (a forward of k + 1). The free drafts' cost-read
planners price a verify from it (`ServingCosts(draft=curve, target=curve)`: a free draft runs no forward, so the
planners read `costs.target` alone)."""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers import DynamicCache

from specheads.decoding.costs import CostCurve, ServingCosts, monotone_curve

VERIFY_TOKENS = (1, 2, 3, 5, 9, 17, 33)
"""The forward sizes the verify curve is timed at (a round verifying k proposed tokens runs a forward of k + 1)."""


@torch.no_grad()
def measure_verify_curve(target: torch.nn.Module, prompt: list[int], repeats: int = 9) -> CostCurve:
    """One request's forward time against the tokens in it, on top of `prompt` cached. The sizes are timed in turn,
    `repeats` times over (a busy moment touches every size alike), the median kept, made non-decreasing
    (`monotone_curve`)."""
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    timings: dict[int, list[float]] = {n: [] for n in VERIFY_TOKENS}
    for _ in range(repeats):
        for n in VERIFY_TOKENS:
            tokens = torch.tensor([[(7 * i + 3) % target.config.vocab_size for i in range(n)]])
            began = time.perf_counter()
            target(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=n)
            timings[n].append(time.perf_counter() - began)
            cache.crop(-n)
    return monotone_curve(VERIFY_TOKENS, [float(np.median(timings[n])) for n in VERIFY_TOKENS])


def free_draft_costs(curve: CostCurve) -> ServingCosts:
    """The costs a free draft's planners read: the target's verify curve (the draft runs no forward)."""
    return ServingCosts(draft=curve, target=curve)
