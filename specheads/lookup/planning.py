"""The cost-read verify length of a free draft's proposal: from per-position conditional acceptance estimates â_k,
verify the k that maximises the expected tokens a round emits over what its verify forward costs. Our round engine's
cost-read planner and vLLM's proposer (`specheads.integrations.vllm`) both call `goodput_length`.

This module imports only numpy: vLLM's environment imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

PACKED_CPU_TOKEN_COST = 0.043
"""One more verified token against a one-token forward on the CPU with prepacked weights (8 tokens ≈ 1.3 forwards)."""


def goodput_length(estimates: Sequence[float], cost: Callable[[int], float]) -> int:
    """The k in 0..len(estimates) maximising (1 + Σ_{j≤k} Π_{i≤j} â_i) / cost(k + 1) (ties: the shorter), `cost(n)`
    the price of a verify forward of n tokens; 0 when a plain target step pays best."""
    survival = np.cumprod(np.clip(np.asarray(estimates, dtype=float), 0.0, 1.0))
    expected = 1.0 + np.concatenate([[0.0], np.cumsum(survival)])
    prices = np.array([cost(k + 1) for k in range(len(expected))])
    return int(np.argmax(expected / prices))


def linear_cost(token_cost: float) -> Callable[[int], float]:
    """cost(n) = 1 + token_cost · (n − 1): a verify of n tokens in one-token forwards."""
    return lambda tokens: 1.0 + token_cost * (tokens - 1)
