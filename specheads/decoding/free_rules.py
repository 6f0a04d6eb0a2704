"""The rules of free drafts (prompt lookup, suffix: `specheads.decoding.free_draft`), each choosing from the whole
proposal how much of it to verify (`StopPolicy.proposal_length`), exact whatever it reads (docs/method.md, "Free
drafts"). Fixed K is `constant_k` (the rule both transformers' prompt lookup and vLLM's n-gram drafts run: the whole
proposal up to K).

- `lookup_match`: K from the match length: verify min(K, max(1, ⌊f · match length⌋)) tokens, f the threshold.
- `suffix_own`: SuffixDecoding's own rule (arctic-inference's `speculate`): at most max_spec_factor · match length
  tokens (factor 1, offset 0), ending before the first whose probability (the proposal's score) is below
  min_token_prob, the threshold (0.1 there). On a suffix draft made with the same values it verifies the whole
  proposal, as the proposer has already cut it so.
- The cost-read planner (`specheads.lookup.planning.goodput_length`, which vLLM's proposer shares): from
  per-position conditional acceptance estimates â_k, verify the k that maximises (1 + Σ_{j≤k} Π_{i≤j} â_i) /
  cost(k + 1 tokens), the expected tokens a round emits over what its verify forward costs (0 when verifying nothing
  pays best: a plain target step). cost is the target's curve where the decode is given one (`ServingCosts.target`,
  a forward of k + 1 tokens against one of 1), else 1 + t · k with t the threshold, the cost of one more verified
  token in one-token forwards (the CPU with prepacked weights, `specheads.pair.packed`: 8 tokens cost about 1.3
  one-token forwards, t ≈ 0.043). The rules differ in where â_k
  comes from:
  - `lookup_table`: vLLM's online acceptance table for suffix drafts (vllm-project/vllm,
    `vllm/v1/worker/gpu/spec_decode/suffix/speculator.py`, Model Runner V2): counts per (draft source, match-length
    bucket, position), buckets 1, 2, 3, 4, 5, 6, 7-10, 11-20, 21+ (`length_bucket`), â = (accepted + 1) / (observed
    + 2), updated from the positions verified (the accepted ones and the first rejected), every count halved (integer
    shift) every 1024 steps, a step being a round of the batch. The source is the proposal's (its match in the prompt
    or the output; vLLM's is the request's own history or its corpus of finished requests). vLLM then sizes each
    request's verify from a cost model of its GPU; here the planner above does.
  - `lookup_scores`: the proposal's own frequency scores, â_k = s_k / s_{k−1} (the share of earlier occurrences that
    agree up to k, given they agreed up to k − 1).
  - `lookup_plan`: an `Estimator` (`specheads.decoding.free_draft`), e.g. a token-only head, given as `estimator=`.
  - `lookup_plan_online`: the same estimates moved online by what the decode verifies, as vLLM's table moves its
    counts: one logit shift b, â'_k = σ(logit(â_k) + b), after every verified position (the accepted ones and the first
    rejected, the positions a decode reaches, so the conditional estimates stay unbiased) a step of the log loss,
    b ← b − rate · (â'_k − accepted), and b halves every `ONLINE_SHIFT_HALF_LIFE` rounds it plans (a shift that stops
    every verify would otherwise never see a position again). A head trained on other prompts is corrected within a
    few rounds of a prompt family it over- or underrates, where retraining it would wait for the next fit
    (docs/results.md, row V4).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from specheads.decoding.costs import CostCurve
from specheads.decoding.free_draft import Estimator, FreePlanner
from specheads.decoding.rules import StopPolicy, register
from specheads.lookup.planning import PACKED_CPU_TOKEN_COST, goodput_length, linear_cost
from specheads.lookup.proposers import Proposal
from specheads.plumbing.errors import UsageError

if TYPE_CHECKING:
    from specheads.decoding.costs import ServingCosts

TABLE_HALF_LIFE = 1024
"""vLLM's `_STATS_HALF_LIFE`: the table's counts are halved every this many steps."""


def length_bucket(match_length: int) -> int:
    """vLLM's `_len_bucket`: match lengths 1-6 get buckets 0-5, then 7-10, 11-20 and 21+ one each (6, 7, 8)."""
    length = max(match_length, 1)
    return length - 1 if length <= 6 else 6 if length <= 10 else 7 if length <= 20 else 8


def conditional_scores(scores: Sequence[float]) -> list[float]:
    """â_k = s_k / s_{k−1} from cumulative scores s (the share agreeing up to k), 0 after a zero."""
    previous, result = 1.0, []
    for score in scores:
        result.append(score / previous if previous > 0 else 0.0)
        previous = score
    return result


@register
@dataclass(frozen=True)
class MatchLength(StopPolicy):
    """Verify min(K, max(1, ⌊f · match length⌋)) proposed tokens, f the threshold (module docstring)."""

    name: ClassVar[str] = "lookup_match"

    def proposal_length(self, proposal: Proposal, estimates: Sequence[float] | None) -> int:
        return min(len(proposal.tokens), max(1, math.floor(self.threshold * proposal.match_length + 1e-9)))


@register
@dataclass(frozen=True)
class SuffixOwn(StopPolicy):
    """SuffixDecoding's rule: at most max_spec_factor · match length tokens, ending before the first scored below
    the threshold (min_token_prob) (module docstring)."""

    max_spec_factor: float = 1.0
    name: ClassVar[str] = "suffix_own"

    def proposal_length(self, proposal: Proposal, estimates: Sequence[float] | None) -> int:
        cap = min(len(proposal.tokens), math.floor(self.max_spec_factor * proposal.match_length + 1e-9))
        return next((k for k, score in enumerate(proposal.scores[:cap]) if score < self.threshold), cap)


@dataclass(frozen=True)
class CostPlanned(StopPolicy):
    """The cost-read planner's rules (module docstring): verify `goodput_length` of the planner's estimates; the
    threshold is the cost of one more verified token in one-token forwards, where the decode has no cost curve."""

    threshold: float = PACKED_CPU_TOKEN_COST

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise UsageError(f"the {self.name} rule's threshold is a verified token's cost in one-token forwards, a "
                             f"number >= 0, got {self.threshold}")

    def proposal_length(self, proposal: Proposal, estimates: Sequence[float] | None) -> int:
        return goodput_length(self.estimates_of(proposal) if estimates is None else estimates,
                              linear_cost(self.threshold))

    def estimates_of(self, proposal: Proposal) -> list[float]:
        """â_k without a planner's state (the proposal alone)."""
        return [1.0] * len(proposal.tokens)

    def planner(self, costs: ServingCosts | None) -> Any:
        return CostPlanner(self, costs.target if costs is not None else None)


class CostPlanner(FreePlanner):
    """The planner of a `CostPlanned` rule: the rule's estimates, its verify length read from the target's cost curve
    where the decode has one (a verify of n tokens against one of 1), else from the rule's threshold."""

    def __init__(self, rule: CostPlanned, curve: CostCurve | None) -> None:
        super().__init__()
        self.rule = rule
        self.cost = (lambda tokens: curve(tokens) / curve(1)) if curve is not None else linear_cost(rule.threshold)

    def estimates(self, row: int, proposal: Proposal) -> list[float] | None:
        return self.rule.estimates_of(proposal)

    def proposal_length(self, row: int, proposal: Proposal, rule: Any) -> int:
        """The row's verify length this round: `goodput_length` of its estimates at this planner's cost."""
        return goodput_length(self.estimates(row, proposal), self.cost)


@register
@dataclass(frozen=True)
class ProposalScores(CostPlanned):
    """The cost-read planner on the proposal's own scores (module docstring)."""

    name: ClassVar[str] = "lookup_scores"

    def estimates_of(self, proposal: Proposal) -> list[float]:
        return conditional_scores(proposal.scores)


@register
@dataclass(frozen=True)
class EstimatorPlanned(CostPlanned):
    """The cost-read planner on an `Estimator`'s â_k (a token-only head), given as `estimator=`."""

    estimator: Estimator | None = field(default=None, compare=False)
    name: ClassVar[str] = "lookup_plan"

    def planner(self, costs: ServingCosts | None) -> Any:
        if self.estimator is None:
            raise UsageError("the lookup_plan rule reads acceptance estimates: give it estimator= (a token-only head, "
                             "specheads.lookup.token_head.TokenHead.load(folder)), or use lookup_table or lookup_scores")
        return EstimatorPlanner(self, costs.target if costs is not None else None)


class EstimatorPlanner(CostPlanner):
    """An `Estimator`'s â_k of each row's proposal."""

    def estimates(self, row: int, proposal: Proposal) -> list[float] | None:
        return list(self.rule.estimator.estimates(proposal))


HEAD_RULES = ("lookup_plan", "lookup_plan_online")
"""The rules that read a token head (`estimator=`)."""
ONLINE_SHIFT_RATE = 0.3
"""`lookup_plan_online`'s step on the logit shift per verified position (chosen on the dev prompts' switching queue)."""
ONLINE_SHIFT_HALF_LIFE = 256
"""Rounds planned over which `lookup_plan_online`'s shift halves."""


@register
@dataclass(frozen=True)
class OnlineEstimatorPlanned(EstimatorPlanned):
    """The cost-read planner on an `Estimator`'s â_k shifted online in logit by the positions it verified (module
    docstring)."""

    rate: float = ONLINE_SHIFT_RATE
    half_life: float = ONLINE_SHIFT_HALF_LIFE
    name: ClassVar[str] = "lookup_plan_online"

    def planner(self, costs: ServingCosts | None) -> Any:
        EstimatorPlanned.planner(self, costs)  # refuses a rule without an estimator
        return OnlineShiftPlanner(self, costs.target if costs is not None else None)


def shifted(estimate: float, shift: float) -> float:
    """σ(logit(estimate) + shift), the estimate kept inside (0, 1)."""
    clipped = min(max(estimate, 1e-6), 1 - 1e-6)
    return 1 / (1 + math.exp(-(math.log(clipped / (1 - clipped)) + shift)))


class OnlineShiftPlanner(EstimatorPlanner):
    """An `Estimator`'s â_k with one logit shift learned online from every verified position (module docstring)."""

    def __init__(self, rule: OnlineEstimatorPlanned, curve: CostCurve | None) -> None:
        super().__init__(rule, curve)
        self.shift = 0.0
        self.read: dict[int, list[float]] = {}  # per row, the estimator's â_k of the proposal it planned

    def estimates(self, row: int, proposal: Proposal) -> list[float] | None:
        self.read[row] = list(self.rule.estimator.estimates(proposal))
        return [shifted(estimate, self.shift) for estimate in self.read[row]]

    def proposal_length(self, row: int, proposal: Proposal, rule: Any) -> int:
        self.shift *= 0.5 ** (1 / self.rule.half_life)
        return super().proposal_length(row, proposal, rule)

    def observe(self, outcomes: Mapping[int, list[Any]]) -> None:
        for row, checked in outcomes.items():
            read = self.read.get(row)
            if read is None or row not in self.lengths:
                continue
            for outcome in checked:
                self.shift -= self.rule.rate * (shifted(read[outcome.position - 1], self.shift) - float(outcome.accepted))
        super().observe(outcomes)


@register
@dataclass(frozen=True)
class AcceptanceTable(CostPlanned):
    """vLLM's online acceptance table feeding the cost-read planner (module docstring)."""

    name: ClassVar[str] = "lookup_table"

    def planner(self, costs: ServingCosts | None) -> Any:
        return TablePlanner(self, costs.target if costs is not None else None)


class TablePlanner(CostPlanner):
    """vLLM's table: accepted and observed counts per (source, length bucket, 0-based position)."""

    def __init__(self, rule: CostPlanned, curve: CostCurve | None) -> None:
        super().__init__(rule, curve)
        self.counts: dict[tuple[str, int, int], list[int]] = defaultdict(lambda: [0, 0])
        self.steps = 0

    def estimates(self, row: int, proposal: Proposal) -> list[float] | None:
        bucket = length_bucket(proposal.match_length)
        counts = [self.counts.get((proposal.source, bucket, k), (0, 0)) for k in range(len(proposal.tokens))]
        return [(accepted + 1) / (observed + 2) for accepted, observed in counts]

    def observe(self, outcomes: Mapping[int, list[Any]]) -> None:
        for row, checked in outcomes.items():
            proposal = self.planned.get(row)
            if proposal is None or row not in self.lengths:
                continue
            bucket = length_bucket(proposal.match_length)
            for outcome in checked:
                count = self.counts[(proposal.source, bucket, outcome.position - 1)]
                count[0] += int(outcome.accepted)
                count[1] += 1
        super().observe(outcomes)
        self.steps += 1
        if self.steps % TABLE_HALF_LIFE == 0:
            for count in self.counts.values():
                count[0] >>= 1
                count[1] >>= 1
