"""A calibrated head's stop rule read from the costs: no tuned threshold (docs/method.md "A stop rule read from the
costs").

A round that drafts k candidates and has the target check them costs T(k) = c·(1 + h)·k + v(k) target-forward units
(c = t_draft/t_target; h the head's forward over the candidate it scores in draft forwards, `head_forward_cost`, 0
before the engine prices it; v(k) the target's forward over k + 1 tokens against its forward over one, 1 on a flat
curve) and yields R(k) = 1 + Σ_{j≤k} S_j tokens in expectation, S_j the chance that the round's first j candidates are all
accepted. The decoder that maximises the long-run rate ρ* = E[R]/E[T] maximises E[R − ρ*·T] in every round
(Dinkelbach), so it drafts one more candidate while that candidate's expected token is worth its cost at ρ*:

    S_k · μ_{k+1} > ρ* · (c·(1 + h) + v(k+1) − v(k))

where S_k is the calibrated survival product the head has after drafting candidate k (an `at_draft` head's
Π_{j≤k} â_j) and μ_{k+1} the expected acceptance of the next candidate before it is drawn. The rule estimates both
from what the request has seen, so nothing is tuned:
- μ: the mean calibrated â over the request's scored candidates so far (this round's included);
- ρ*: the request's realised rate, (1 + tokens) / (1 + cost) over its rounds so far, i.e. Dinkelbach's iteration
  started from one step of target-only decoding (one token for one unit).
When the gain S_k·μ − ρ·(c·(1 + h) + Δv) falls with k (S_k never rises; Δv does not fall on a flat, linear or convex
curve), the stopping problem is monotone and the one-step look-ahead is the optimal rule: no look-ahead over the
remaining candidates does better (docs/method.md). Exact: a decision reads only the candidates drafted so far,
each of which the target then checks, and outcomes already observed (`specheads.decoding.rules`).

A block drafter (DSpark: `CostPlanner.price_draft`) runs one forward a round however many candidates it uses, so
T(k) = c·[k ≥ 1] + c·h·k + v(k): once the round drafts, its forward is spent, and one more candidate costs only the
head's forward and the target's extra token, S_k · μ_{k+1} > ρ* · (c·h + v(k+1) − v(k)).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from specheads.decoding.costs import CostCurve, ServingCosts
from specheads.decoding.online import Outcome, PassivePlanner
from specheads.decoding.rules import Drafted, StopPolicy, register
from specheads.plumbing.errors import UsageError


def verify_step(curve: CostCurve | None, drafted: int) -> float:
    """v(k+1) − v(k) for k = `drafted`: what checking one more candidate adds to the target's forward, in units of
    its one-token forward (0 on a flat curve, as counted forwards have it); the request's own forward, one row."""
    if curve is None:
        return 0.0
    return (curve.price(drafted + 2, 1) - curve.price(drafted + 1, 1)) / curve.price(1, 1)


def verify_cost(curve: CostCurve | None, drafted: int) -> float:
    """v(k): the target's forward over k + 1 tokens of the request's row against its forward over one (1 on a flat
    curve), each priced on that one row (`CostCurve.price`)."""
    return 1.0 if curve is None else curve.price(drafted + 1, 1) / curve.price(1, 1)


def drafting_gain(survival: float, next_acceptance: float, rate: float, cost_ratio: float, step: float) -> float:
    """What one more candidate adds to E[R − ρ·T]: its expected token S_k·μ less its cost c + Δv at the rate ρ (a
    tree ranks its next slots by it, `specheads.decoding.tree`)."""
    return survival * next_acceptance - rate * (cost_ratio + step)


def worth_drafting(survival: float, next_acceptance: float, rate: float, cost_ratio: float, step: float) -> bool:
    """Whether one more candidate pays: its expected token S_k·μ against its cost c + Δv at the rate ρ."""
    return drafting_gain(survival, next_acceptance, rate, cost_ratio, step) > 0


@dataclass
class RequestState:
    """What the rule knows of one request: its tokens and cost so far, its scored candidates and this round's
    drafting."""

    tokens: float = 0.0
    cost: float = 0.0
    score_sum: float = 0.0
    scored: int = 0
    drafted: int = 0

    def rate(self) -> float:
        """ρ: (1 + tokens) / (1 + cost), one step of target-only decoding as the prior."""
        return (1.0 + self.tokens) / (1.0 + self.cost)

    def mean_acceptance(self, latest: float) -> float:
        """μ: the mean calibrated â of the request's scored candidates (`latest` when none yet)."""
        return self.score_sum / self.scored if self.scored else latest


@dataclass
class CostPlanner(PassivePlanner):
    """The cost-derived stop rule's per-request state (module docstring)."""

    cost_ratio: float
    curve: CostCurve | None = None  # the target's forward time against its tokens; None: flat (counted forwards)
    requests: dict[int, RequestState] = field(default_factory=dict)
    head_cost: float = 0.0  # h: the head's forward over one candidate in draft forwards (`price_head`)
    block: bool = False  # a block drafter: one draft forward a round that drafts, however many candidates (`price_draft`)
    candidate: float = 0.0  # m: what the draft computes for each candidate after its forward (a DSpark drafter's Markov
    # bias), in draft forwards (`price_draft`)

    @property
    def candidate_cost(self) -> float:
        """What one more candidate costs, in target forwards, once the round drafts: c·(1 + h + m), its draft forward,
        the head's that scores it and what the draft computes for it after its forward; c·(h + m) for a block drafter,
        which drew it from the block's one forward."""
        return self.cost_ratio * (self.head_cost + self.candidate + (0.0 if self.block else 1.0))

    def drafting_cost(self, drafted: int) -> float:
        """What a round's `drafted` candidates cost in draft and head forwards, in target forwards: each its
        `candidate_cost`, and a block drafter's forward, c, where the round drafts at all."""
        return self.candidate_cost * drafted + (self.cost_ratio if self.block and drafted else 0.0)

    def admit(self, row: int) -> None:
        self.requests[row] = RequestState()

    def price_head(self, head_cost: float) -> None:
        self.head_cost = head_cost

    def price_draft(self, block: int | None, candidate: float = 0.0) -> None:
        self.block, self.candidate = block is not None, candidate

    def stops(self, row: int, drafted: Drafted) -> bool:
        state = self.requests.setdefault(row, RequestState())
        state.score_sum += drafted.score
        state.scored += 1
        stop = not worth_drafting(drafted.acceptance, state.mean_acceptance(drafted.score), state.rate(),
                                  self.candidate_cost, verify_step(self.curve, drafted.index))
        state.drafted = drafted.index  # the engine shows every candidate, the one the cap ends a round on too
        return stop

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        for row, checked in outcomes.items():
            state = self.requests.setdefault(row, RequestState())
            drafted = max(state.drafted, len(checked))
            state.tokens += sum(o.accepted for o in checked) + 1
            state.cost += self.drafting_cost(drafted) + verify_cost(self.curve, drafted)
            state.drafted = 0


@register
@dataclass(frozen=True)
class HeadCostStop(StopPolicy):
    """A calibrated head's stop rule read from the costs (module docstring): draft one more candidate while its
    expected token, S_k · μ, is worth its cost at the request's rate, ρ · (c·(1 + h) + Δv), h the head's forward
    (`CostPlanner.price_head`). `threshold` is c = t_draft/t_target, not a tuned value; with serving costs, Δv
    follows the target's curve (flat otherwise)."""

    name: ClassVar[str] = "head_cost"
    reads_head: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.threshold < 1.0:
            raise UsageError(f"the head_cost rule's value is the cost ratio t_draft/t_target, in (0, 1); got "
                             f"{self.threshold}")

    def planner(self, costs: ServingCosts | None) -> Any:
        return CostPlanner(self.threshold, None if costs is None else costs.target)

    def check_head(self, head: Any) -> None:
        super().check_head(head)
        if head.decides not in ("at_draft", "before_draw"):
            raise UsageError(f"the head_cost rule reads the survival product of the candidates drafted so far; a "
                             f"{head.head_type} head decides {head.decides} (a candidate behind); use an on-time "
                             "(specdecpp_ontime) or expected_acceptance head")
