"""Batch-level planners: how much every row of a round drafts and how many of its candidates the target checks.

A stop rule decides for one row. In a batch the target checks every row's candidates in one forward, so what matters
is how many candidates of which rows go into it. A planner sees the whole round:
- `admit(row)`: a new request takes a row;
- `round_cap(rows)`: before drafting, the most candidates any row drafts this round;
- `stops(row, drafted)`: while drafting, whether a row's drafting ends after this candidate (beside the rule's stop);
- `verify_lengths(rounds)`: after drafting, how many of each row's candidates (a prefix) the target checks;
- `observe(outcomes)`: the round's checked candidates and their outcomes, for planners that learn from them
  (`specheads.decoding.online` has the rules that adapt at run time).

Exactness (docs/decoding-core.md "Verify budgets"): speculative sampling stays exact when, for every row, whether
candidate ŷ_j is checked depends only on what was known before ŷ_j was drawn: the row's earlier candidates, other
rows (independent draws) and the past. `round_cap` reads only the past; `stops` only ends drafting, which any function
of the candidates drafted so far may do. `verify_lengths` ranks positions by the survival product
S_j = Π_{i≤j} α̂_i of an expected-acceptance head, which reads nothing of ŷ_i (`decides: before_draw`), so S_j is
known before ŷ_j is drawn; S is non-increasing along a row, so the greedy takes a prefix of each row, and whether
it reaches ŷ_j depends only on gains at least S_j: the row's earlier positions and other rows'.
The goodput it maximises is SV's, (expected accepted + one per row) / t_target(tokens verified): the round's draft
time is left out of it, since it depends on how far each row drafted, which depends on the row's later candidates.
Fed a score that has read ŷ_j (an `at_draft` head), the same greedy is lossy (tests/test_budget.py shows by how much).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from specheads.decoding.costs import CostCurve, ServingCosts
from specheads.decoding.online import Outcome, PassivePlanner
from specheads.decoding.rules import Drafted


def goodput_verify_lengths(survival: Mapping[int, list[float]], target: CostCurve) -> tuple[dict[int, int], float]:
    """SV's batch greedy: each row's verify length, from its candidates' survival products S_1 ≥ S_2 ≥ … .

    Start with no candidate checked (every row still gets the target's token: B tokens for t(B)); repeatedly add
    the position with the largest S (ties: lower row, earlier position) while the goodput
    (B + Σ chosen S) / t(B + chosen) does not fall; stop at the first that would lower it. Also returns the S of that
    first refused position (0 when none was refused): the marginal value a candidate needed this round."""
    lengths = {row: 0 for row in survival}
    tokens = value = float(len(survival))
    best = value / target(int(tokens)) if survival else 0.0
    order = sorted((-clean(score), row, index) for row, scores in survival.items() for index, score in enumerate(scores, 1))
    for negative, row, index in order:
        if index != lengths[row] + 1:  # never for a non-increasing S (the sort puts a row's positions in order)
            continue
        goodput = (value - negative) / target(int(tokens) + 1)
        if goodput < best:
            return lengths, -negative
        tokens, value, best = tokens + 1, value - negative, goodput
        lengths[row] = index
    return lengths, 0.0


def clean(score: float) -> float:
    """A survival in [0, 1]; a non-finite one (an overflowing head) counts as 0 so the sort stays a total order."""
    return min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0


class BudgetPlanner(PassivePlanner):
    """The verify budget: every row drafts up to the cap, stopping early once its survival S_k falls below the
    marginal value the previous round's greedy refused (what a candidate had to be worth to be checked; the rule's
    floor when it refused none), then the target checks the prefixes `goodput_verify_lengths` chooses."""

    def __init__(self, costs: ServingCosts, floor: float = 0.0):
        self.costs, self.floor, self.cutoff = costs, floor, 0.0

    def stops(self, row: int, drafted: Drafted) -> bool:
        return drafted.acceptance < max(self.floor, self.cutoff)

    def verify_lengths(self, survival: Mapping[int, list[float]]) -> dict[int, int]:
        lengths, self.cutoff = goodput_verify_lengths(survival, self.costs.target)
        return lengths


@dataclass
class SmartSpecPlanner(PassivePlanner):
    """SmartSpec's goodput K (Liu et al. 2024): one K for the whole batch each round, the one that maximises the
    modelled goodput B · Σ_{j=0..K} a^j / (Σ_{s≤K} t_draft(B) + t_target(B · (K + 1))), with a the token acceptance
    rate estimated from the past rounds (an exponential average of accepted and rejected counts: a = accepted /
    (accepted + rejections), the geometric model's estimate). K = 0 is plain target decoding; its rounds check
    nothing, so the estimate drifts back to the prior and drafting is tried again."""

    costs: ServingCosts
    smoothing: float = 0.1
    accepted: float = 7.0  # a prior of a = 0.7 worth ten tokens
    rejections: float = 3.0
    max_k: int | None = None  # the largest K it may pick (the rule's threshold); the cap otherwise
    prior: tuple[float, float] = (7.0, 3.0)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejections)

    def round_cap(self, rows: int, cap: int) -> int:
        rate = self.rate

        def goodput(k: int) -> float:
            expected = rows * sum(rate**j for j in range(k + 1))
            return expected / (k * self.costs.draft(rows) + self.costs.target(rows * (k + 1)))

        largest = cap if self.max_k is None else min(cap, self.max_k)
        return max(range(largest + 1), key=lambda k: (goodput(k), -k))

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        checked = [outcome for outcome in outcomes.values() if outcome]
        kept = 1.0 - self.smoothing
        if not checked:  # a round of plain target decoding: drift back to the prior, so that drafting is tried again
            self.accepted = kept * self.accepted + self.smoothing * self.prior[0]
            self.rejections = kept * self.rejections + self.smoothing * self.prior[1]
            return
        self.accepted = kept * self.accepted + self.smoothing * sum(o.accepted for row in checked for o in row)
        self.rejections = kept * self.rejections + self.smoothing * sum(not row[-1].accepted for row in checked)
