"""Exact verification of drafted candidates (speculative sampling's accept-or-resample), apart from the loop.

Candidate ŷ_i drawn from q is accepted with probability min(1, p(ŷ_i)/q(ŷ_i)); the first rejected one is replaced
by a draw from norm(max(0, p − q)); when every checked candidate is accepted, a bonus token may be drawn from p at
the next position. The output then follows the target's distribution (SpecDec++ Appendix, the deep dive's proof).
Every draw uses the row's own generator, in the order the loop makes them.

A NaN would make every test pass (min(1, exp(log p − NaN)) is 1 in Python): non-finite logits are refused at the forward
that made them (`refuse_non_finite`), and `accepts` refuses a NaN ratio whichever path reached it.
"""

from __future__ import annotations

import math

import torch

from specheads.model_outputs.sampling import SamplingTransform, draw_from_log_probs, uniforms
from specheads.plumbing.errors import UsageError

NON_FINITE_CAUSE = ("its weights hold NaN or inf, or its dtype overflowed (float16); give it finite weights, or load "
                    "it in float32 or bfloat16")
"""The likely cause of non-finite logits and the fix, for the messages that refuse them."""


def refuse_non_finite(logits: torch.Tensor, model: str) -> torch.Tensor:
    """`logits` when none is NaN or +inf (−inf rules a token out: q = 0 off a draft's vocabulary); otherwise a
    UsageError naming `model` ("the draft", "the target"). One reduction over the forward's output."""
    if not bool((logits < math.inf).all()):
        raise UsageError(f"{model}'s logits hold NaN or +inf at this forward: {NON_FINITE_CAUSE}")
    return logits


def draw(log_probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a row of log-probabilities."""
    return int(draw_from_log_probs(log_probs.unsqueeze(0), uniforms(generator, 1))[0])


def accepts(logp: float, logq: float, generator: torch.Generator) -> bool:
    """The p/q test: True with probability min(1, p/q); a NaN p or q is refused, never accepted."""
    ratio = logp - logq
    if math.isnan(ratio):
        raise UsageError(f"a candidate's log p ({logp}) or log q ({logq}) is NaN: the target's or the draft's logits "
                         f"are not finite; {NON_FINITE_CAUSE}")
    return float(uniforms(generator, 1)[0]) <= min(1.0, math.exp(ratio))


def residual(probs: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) over the last axis, the distribution that makes a rejection exact (p itself where p == q:
    a rejection then has probability 0, and the draw stays valid anyway)."""
    left = (probs - proposal).clamp_min(0)
    total = left.sum(-1, keepdim=True)
    return torch.where(total > 0, left / total.clamp_min(torch.finfo(left.dtype).tiny), probs)


def verify_siblings(logp_all: torch.Tensor, candidates: list[tuple[int, torch.Tensor | None]],
                    generator: torch.Generator) -> tuple[int | None, int | None]:
    """Recursive rejection sampling of the candidates for one position (the siblings of a tree node, in the order
    they were drafted; a chain has one). Candidate i is (token, the log-probs q_i it was drawn from: q without the
    earlier siblings, renormalised; None for a token chosen rather than drawn, whose q_i is the one-hot of it).
    With p_1 = p, candidate i is accepted with min(1, p_i(x)/q_i(x)); a rejection leaves p_{i+1} = norm(max(0,
    p_i − q_i)); when all are rejected the position's token is drawn from the last p. The token follows p whatever
    the candidates, provided each drawn one was drawn from its q_i and whether it was drafted at all was settled
    before its draw (docs/method.md, "Tree drafts"). p may sit on another device than q (a split target's last
    shard). Returns (the accepted candidate's index, None) or (None, the token drawn)."""
    log_probs = logp_all
    for index, (token, proposal) in enumerate(candidates):
        proposal = None if proposal is None else proposal.to(logp_all.device)  # q meets p on p's device
        if accepts(float(log_probs[token]), 0.0 if proposal is None else float(proposal[token]), generator):
            return index, None
        drawn_from = (torch.zeros_like(logp_all).index_fill_(0, torch.tensor([token], device=logp_all.device), 1.0)
                      if proposal is None else proposal.exp())
        log_probs = residual(log_probs.exp(), drawn_from).log()
    return None, draw(log_probs, generator)


def verify(logits: torch.Tensor, candidates: list[int], logq_rows: list[torch.Tensor], first: int, bonus: bool,
           transform: SamplingTransform, generator: torch.Generator) -> tuple[int, int | None]:
    """Check `candidates[first:]` against the target's logits at their positions (row i of `logits` is the position
    of candidate `first + i`; one more row when `bonus`): (how many candidates stand — the unchecked `first` ones
    and the accepted checked ones —, the token that follows them: a residual draw at the first rejection, a bonus
    draw from p when all were accepted and `bonus`, else None). Each position is `verify_siblings` of one candidate."""
    for row, index in enumerate(range(first, len(candidates))):
        accepted, token = verify_siblings(transform.log_probs(logits[row]), [(candidates[index], logq_rows[index])],
                                          generator)
        if accepted is None:
            return index, token
    if not bonus:
        return len(candidates), None
    return len(candidates), draw(transform.log_probs(logits[len(candidates) - first]), generator)
