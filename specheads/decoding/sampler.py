"""Exact verification of drafted candidates (speculative sampling's accept-or-resample), apart from the loop.

Candidate ŷ_i drawn from q is accepted with probability min(1, p(ŷ_i)/q(ŷ_i)); the first rejected one is replaced
by a draw from norm(max(0, p − q)); when every checked candidate is accepted, a bonus token may be drawn from p at
the next position. The output then follows the target's distribution (SpecDec++ Appendix, the deep dive's proof).
Every draw uses the row's own generator, in the order the loop makes them.
"""

from __future__ import annotations

import math

import torch

from specheads.sampling import SamplingTransform, draw_from_log_probs, uniforms


def draw(log_probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a row of log-probabilities."""
    return int(draw_from_log_probs(log_probs.unsqueeze(0), uniforms(generator, 1))[0])


def accepts(logp: float, logq: float, generator: torch.Generator) -> bool:
    """The p/q test: True with probability min(1, p/q)."""
    return float(uniforms(generator, 1)[0]) <= min(1.0, math.exp(logp - logq))


def residual_draw(logp_all: torch.Tensor, logq_all: torch.Tensor, generator: torch.Generator) -> int:
    """A draw from norm(max(0, p − q)), the distribution that makes a rejection exact."""
    residual = (logp_all.exp() - logq_all.exp()).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q: a rejection has probability 0, keep the draw valid anyway
        residual = logp_all.exp()
    return draw(residual.log(), generator)


def verify(logits: torch.Tensor, candidates: list[int], logq_rows: list[torch.Tensor], first: int, bonus: bool,
           transform: SamplingTransform, generator: torch.Generator) -> tuple[int, int | None]:
    """Check `candidates[first:]` against the target's logits at their positions (row i of `logits` is the position
    of candidate `first + i`; one more row when `bonus`): (how many candidates stand — the unchecked `first` ones
    and the accepted checked ones —, the token that follows them: a residual draw at the first rejection, a bonus
    draw from p when all were accepted and `bonus`, else None)."""
    for row, index in enumerate(range(first, len(candidates))):
        logp_all = transform.log_probs(logits[row])
        token = candidates[index]
        if not accepts(float(logp_all[token]), float(logq_rows[index][token]), generator):
            return index, residual_draw(logp_all, logq_rows[index], generator)
    if not bonus:
        return len(candidates), None
    return len(candidates), draw(transform.log_probs(logits[len(candidates) - first]), generator)
