"""Decoding rules: when a row stops drafting in a round, and which of its candidates the target checks.

A rule sees each candidate the moment it is drafted (`Drafted`) and says whether the round ends after it
(`stop`); once the round's drafting ends it says from which candidate on the target checks (`verify_from`), or
that no target call is needed. Stop policies (SpecDec++ and its baselines) check every candidate and earn a bonus
token when all are accepted: exact speculative sampling. SPRINTER's rule stops at the first candidate its verifier
flags and checks only that one, the earlier ones standing unverified: approximate by design (SPRINTER Theorem 1).

Decision timing (docs/method.md): after drafting candidate ŷ_k the rule sees the draft's signals for ŷ_k and, for a
learned head, the product of the acceptance predictions it has: an `at_draft` head (specdecpp_ontime, the SPRINTER
verifier) has scored ŷ_k itself, so the product is Π_{j≤k} â_j; a `one_step_late` head (specdecpp_resnet) reads the
state that has read ŷ_j, which exists only once ŷ_{j+1} is drafted, so at step k it knows â_1..â_{k-1}.

Batch-level rules (`budget`, `smartspec`, and the goodput planner read by a head, `goodput`, or by a free signal,
`dcut` and `vllm_adaptive`) also hand the engine a planner (`specheads.decoding.planners`) that sees the
whole round: how far every row may draft, and how many of each row's candidates the target checks.

A new rule is one class here, registered in `RULES`; the round engine (`specheads.decoding.engine`) runs any of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from specheads.errors import UsageError

if TYPE_CHECKING:
    from specheads.decoding.costs import ServingCosts


@dataclass(frozen=True)
class Drafted:
    """What a rule sees after the draft proposed candidate number `index` (1-based) of a round."""

    index: int
    prob: float  # the draft's probability of the candidate (untempered under greedy decoding)
    entropy: float  # H(q) at the step that drafted it (untempered under greedy decoding)
    acceptance: float  # Π â_j over the round's candidates the head has scored (1.0 before it has one): with a
    # `before_draw` head, the survival product S_k, known before the candidate was drawn
    score: float = 1.0  # the head's score of this candidate (an `at_draft` head; 1.0 otherwise)
    ends_output: bool = False  # the candidate is a stop token
    top1: float = 1.0  # max q at the step that drafted it (untempered under greedy decoding): known before the draw


@dataclass(frozen=True)
class StopPolicy:
    """Base of the exact rules: stop at the cap, verify every candidate. `threshold` is the rule's knob (K for
    constant K)."""

    threshold: float
    max_draft: int | None = 8

    name: ClassVar[str] = ""
    reads_head: ClassVar[bool] = False
    hindsight: ClassVar[bool] = False  # the oracle counts only the candidates it would have kept
    bonus: ClassVar[bool] = True  # a fully accepted round earns a token from p

    def __post_init__(self) -> None:
        if self.max_draft is not None and self.max_draft < 1:
            raise UsageError(f"max_draft must be at least 1, got {self.max_draft}")

    def cap(self, room: int) -> int:
        """The most candidates a round may draft with `room` tokens left to generate: one fewer under a rule with a
        bonus token, which fills the last slot for free (a candidate there could only take the bonus token's place,
        at the cost of a draft forward), as transformers' assisted generation drafts."""
        room = max(room - 1, 0) if self.bonus else room
        return room if self.max_draft is None else min(self.max_draft, room)

    def stop(self, drafted: Drafted) -> bool:
        """True when the round ends after this candidate."""
        return (self.max_draft is not None and drafted.index >= self.max_draft) or self.signal_says_stop(drafted)

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return False

    def verify_from(self, round_: list[Drafted]) -> int | None:
        """The first of the round's candidates (0-based) the target checks; None: no target call this round."""
        return 0

    def planner(self, costs: ServingCosts | None) -> Any:
        """The batch-level planner of a decode (`specheads.decoding.planners`); None for a per-row rule."""
        return None

    reads_companion: ClassVar[bool] = False  # SV's companion predictor scores the candidates

    def check_head(self, head: Any) -> None:
        """Refuse a head this rule cannot use."""
        if self.reads_head and head is None:
            raise UsageError(f"the {self.name} rule needs an acceptance head")


@dataclass(frozen=True)
class ConstantK(StopPolicy):
    """Always K candidates per round (the usual default of speculative decoding)."""

    name: ClassVar[str] = "constant_k"

    def __post_init__(self) -> None:
        if self.threshold < 1 or self.threshold != int(self.threshold):
            raise UsageError(f"constant K must be a whole number >= 1, got {self.threshold}")

    def stop(self, drafted: Drafted) -> bool:
        return drafted.index >= int(self.threshold)


@dataclass(frozen=True)
class Svip(StopPolicy):
    """SVIP: stop when sqrt(H(q)) > h at the step that drafted the candidate."""

    name: ClassVar[str] = "svip"

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return math.sqrt(max(drafted.entropy, 0.0)) > self.threshold


@dataclass(frozen=True)
class Confidence(StopPolicy):
    """Draft confidence (transformers' assisted generation): stop when q(ŷ) < h."""

    name: ClassVar[str] = "confidence"

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return drafted.prob < self.threshold


@dataclass(frozen=True)
class HeadStop(StopPolicy):
    """SpecDec++: stop when the predicted chance of at least one rejection, 1 − Π â, exceeds h."""

    name: ClassVar[str] = "head"
    reads_head: ClassVar[bool] = True

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return 1.0 - drafted.acceptance > self.threshold


@dataclass(frozen=True)
class HeadCostStop(StopPolicy):
    """A calibrated head's stop rule read from the costs (`specheads.decoding.cost_rule`): draft one more candidate
    while its expected token, S_k · μ, is worth its cost at the request's rate, ρ · (c + Δv). `threshold` is c =
    t_draft/t_target, not a tuned value; with serving costs, Δv follows the target's curve (flat otherwise)."""

    name: ClassVar[str] = "head_cost"
    reads_head: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.threshold < 1.0:
            raise UsageError(f"the head_cost rule's value is the cost ratio t_draft/t_target, in (0, 1); got "
                             f"{self.threshold}")

    def planner(self, costs: ServingCosts | None) -> Any:
        from specheads.decoding.cost_rule import CostPlanner

        return CostPlanner(self.threshold, None if costs is None else costs.target)

    def check_head(self, head: Any) -> None:
        super().check_head(head)
        if head.decides not in ("at_draft", "before_draw"):
            raise UsageError(f"the head_cost rule reads the survival product of the candidates drafted so far; a "
                             f"{head.head_type} head decides {head.decides} (a candidate behind); use an on-time "
                             "(specdecpp_ontime) or expected_acceptance head")


@dataclass(frozen=True)
class SvCompanionStop(HeadStop):
    """SV's companion predictor as a stop rule (`specheads.decoding.companion`): the companion runs beside the draft
    and scores each candidate when it is drafted; the head's rule on those scores, stop when 1 − Π p̂ exceeds h. Its
    prediction reads the drawn token, so it ends drafting (exact) and never ranks drafted positions. Each companion
    forward is counted at its cost in draft forwards (`specheads.decoding.companion.forward_cost`)."""

    name: ClassVar[str] = "sv_companion"
    reads_head: ClassVar[bool] = False
    reads_companion: ClassVar[bool] = True


@dataclass(frozen=True)
class Oracle(StopPolicy):
    """The hindsight oracle of SpecDec++ Theorem 4.1: stop just before the first candidate the target rejects.

    It drafts up to the cap and counts only the accepted candidates as drafted, and one draft forward for each of
    them (what it would have spent had it known), so it never discards a token; the target's call then yields the
    token at the first rejection (exact, as in a normal round). eval reads the same accounting off constant K_max.
    """

    name: ClassVar[str] = "oracle"
    hindsight: ClassVar[bool] = True


@dataclass(frozen=True)
class SprinterRule(StopPolicy):
    """SPRINTER: draft until the verifier scores a candidate below `threshold` (or the output ends); the target
    checks only that candidate (accept, or resample from norm(max(0, p − q))), the earlier ones stand unverified,
    and a round whose candidates all passed calls no target. No bonus token: the next round drafts as usual."""

    max_draft: int | None = None
    name: ClassVar[str] = "sprinter"
    reads_head: ClassVar[bool] = True
    bonus: ClassVar[bool] = False

    def stop(self, drafted: Drafted) -> bool:
        return self.flags(drafted) or drafted.ends_output

    def flags(self, drafted: Drafted) -> bool:
        """True when the verifier sends this candidate to the target."""
        return drafted.score < self.threshold

    def verify_from(self, round_: list[Drafted]) -> int | None:
        return len(round_) - 1 if self.flags(round_[-1]) else None


def require_costs(name: str, costs: ServingCosts | None) -> ServingCosts:
    if costs is None:
        raise UsageError(f"the {name} rule plans from the models' cost curves; pass costs (specheads.decoding.costs)")
    return costs


@dataclass(frozen=True)
class VerifyBudget(StopPolicy):
    """The batch-level verify budget (SV §5, DSpark's planner): every row drafts up to the cap, stopping early once
    the survival product S_k = Π α̂_j of an expected-acceptance head falls below `threshold` (the floor) or below
    what the previous round's greedy refused; then the verify lengths of all rows are chosen together by the goodput
    greedy. Exact: it needs a head that decides before the draw (module docstring of `specheads.decoding.planners`)."""

    name: ClassVar[str] = "budget"
    reads_head: ClassVar[bool] = True

    def planner(self, costs: ServingCosts | None) -> Any:
        from specheads.decoding.planners import BudgetPlanner

        return BudgetPlanner(require_costs(self.name, costs), self.threshold)

    def check_head(self, head: Any) -> None:
        super().check_head(head)
        if head.decides != "before_draw":
            raise UsageError(f"the budget rule ranks drafted positions across rows by the head's survival product; a "
                             f"{head.head_type} head decides {head.decides} (it has read the drafted token), which makes "
                             "the output differ from the target's; use an expected_acceptance head")


@dataclass(frozen=True)
class SmartSpecK(StopPolicy):
    """SmartSpec's goodput K: one K per round for the whole batch, from the acceptance rate of past rounds and the
    cost curves (`specheads.decoding.planners.SmartSpecPlanner`); `threshold` is the largest K it may pick."""

    name: ClassVar[str] = "smartspec"

    def planner(self, costs: ServingCosts | None) -> Any:
        from specheads.decoding.planners import SmartSpecPlanner

        return SmartSpecPlanner(require_costs(self.name, costs), max_k=int(self.threshold))


@dataclass(frozen=True)
class GoodputPlan(StopPolicy):
    """The goodput planner (`specheads.decoding.planners.GoodputPlanner`) reading an expected-acceptance head: per
    round, the batch's K from the modelled goodput with the draft's time counted (K = 0 is plain decoding), each
    row's drafting ended once one more candidate is not worth its draft and target time, and the verify lengths
    chosen in order of the survival products. `threshold` is the largest K it may plan (it needs no tuned value).
    Exact with a head that decides before the draw (docs/decoding-core.md "Verify budgets")."""

    name: ClassVar[str] = "goodput"
    reads_head: ClassVar[bool] = True
    signal: ClassVar[str] = "head"  # what ranks the positions (`specheads.decoding.planners.SIGNALS`)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threshold < 1 or self.threshold != int(self.threshold):
            raise UsageError(f"the {self.name} rule's value is the largest K it may plan, a whole number >= 1; got "
                             f"{self.threshold}")

    def planner(self, costs: ServingCosts | None) -> Any:
        from specheads.decoding.planners import GoodputPlanner, make_signal

        return GoodputPlanner(require_costs(self.name, costs), make_signal(self.signal, int(self.threshold)),
                              max_k=int(self.threshold))

    def check_head(self, head: Any) -> None:
        super().check_head(head)
        if self.reads_head and head.decides != "before_draw":
            raise UsageError(f"the {self.name} rule ranks drafted positions across rows by the head's survival "
                             f"product; a {head.head_type} head decides {head.decides} (it has read the drafted "
                             "token), which makes the output differ from the target's; use an expected_acceptance head")


@dataclass(frozen=True)
class DCut(GoodputPlan):
    """D-Cut (Tencent AngelSlim; vLLM PR #44885, vllm-ascend PR #15147) in the goodput planner: each candidate's
    acceptance is the draft's top-1 probability max q_k, its survival the product over the round, no training.
    D-Cut reads the probability of the token its greedy drafter selected, which is max q_k; with sampled drafts that
    would be q(ŷ_k), a score of the drawn token that makes ranking inexact, so max q_k (known before the draw) is used
    (docs/decoding-core.md "The field's free signals")."""

    name: ClassVar[str] = "dcut"
    reads_head: ClassVar[bool] = False
    signal: ClassVar[str] = "top1"


@dataclass(frozen=True)
class VllmAdaptive(GoodputPlan):
    """vLLM's adaptive verification signal (PR #47808, #52228) in the goodput planner: each candidate's acceptance is
    vLLM's online estimate σ(w · logit(max q_k) + b_k), refitted from the outcomes every 100 rounds, drafting to the
    cap and checking every candidate until its third refit. vLLM's newest estimator reads logit(q(ŷ_k)) of the drawn
    token, which ranks inexactly under sampled drafts; max q_k (PR #52228's feature) is used (docs/decoding-core.md
    "The field's free signals")."""

    name: ClassVar[str] = "vllm_adaptive"
    reads_head: ClassVar[bool] = False
    signal: ClassVar[str] = "vllm"


@dataclass(frozen=True)
class VllmOnline(StopPolicy):
    """vLLM's online acceptance estimator (`specheads.decoding.online.VllmEstimator`) as a stop rule: end the round
    once 1 − Π p_k exceeds `threshold`; it drafts to the cap until its third refit."""

    name: ClassVar[str] = "vllm_online"

    def planner(self, costs: ServingCosts | None) -> Any:
        from specheads.decoding.online import VllmEstimator

        return VllmEstimator(self.threshold, self.max_draft or 8)


@dataclass(frozen=True)
class AdaEdlRule(StopPolicy):
    """AdaEDL (`specheads.decoding.online.AdaEdl`): stop once the entropy bound 1 − sqrt(0.2 · H(q)) falls below λ
    (`threshold`, where each request starts), λ adapted from the request's recent acceptance."""

    name: ClassVar[str] = "adaedl"

    def planner(self, costs: ServingCosts | None) -> Any:
        from specheads.decoding.online import AdaEdl

        return AdaEdl(self.threshold)


@dataclass(frozen=True)
class AssistedGeneration(StopPolicy):
    """Base of transformers' assisted-generation rules: its assistant stops drafting at a stop token."""

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return drafted.ends_output


@dataclass(frozen=True)
class TransformersDefault(AssistedGeneration):
    """transformers' assisted generation as users get it (`specheads.decoding.online.TransformersConfidence`): the
    confidence rule from `threshold` (0.4), re-tuned by ROC at run time, at most `max_draft` (20) candidates and one
    fewer than the tokens left (`cap`), ending at a stop token as its assistant does."""

    name: ClassVar[str] = "transformers"

    def planner(self, costs: ServingCosts | None) -> Any:
        from specheads.decoding.online import TransformersConfidence

        return TransformersConfidence(self.threshold)


@dataclass(frozen=True)
class TransformersHeuristicK(AssistedGeneration):
    """transformers' older default, the `heuristic` schedule (`specheads.decoding.online.TransformersHeuristic`):
    `threshold` candidates at first (5), + 2 after a fully accepted round, else − 1 (at least 1); no cap but one
    fewer than the tokens left to generate (`cap`)."""

    max_draft: int | None = None
    name: ClassVar[str] = "transformers_heuristic"

    def planner(self, costs: ServingCosts | None) -> Any:
        from specheads.decoding.online import TransformersHeuristic

        return TransformersHeuristic(int(self.threshold))


RULES: dict[str, type[StopPolicy]] = {cls.name: cls for cls in (ConstantK, Svip, Confidence, HeadStop, HeadCostStop, Oracle, SprinterRule,
                                                                 VerifyBudget, SmartSpecK, VllmOnline, AdaEdlRule, TransformersDefault,
                                                                 TransformersHeuristicK, SvCompanionStop, GoodputPlan, DCut,
                                                                 VllmAdaptive)}
STOP_POLICIES = ("constant_k", "svip", "confidence", "head", "head_cost", "oracle", "vllm_online", "adaedl", "transformers",
                 "transformers_heuristic", "sv_companion")
ONLINE_POLICIES = ("vllm_online", "adaedl", "transformers", "transformers_heuristic")
BASELINES = {"constant_k": "the best constant K", "svip": "SVIP at its best threshold",
             "confidence": "draft confidence at its best threshold",
             "vllm_online": "vLLM's online acceptance estimator at its best threshold",
             "adaedl": "AdaEDL's entropy bound, λ adapted from recent acceptance, at its best starting λ",
             "transformers": "transformers' assisted-generation default (confidence 0.4, re-tuned by ROC)",
             "transformers_heuristic": "transformers' older heuristic schedule (K from 5, +2 / −1)",
             "sv_companion": "SV's companion predictor at its best threshold (its forwards counted at their cost in draft "
                             "forwards)"}
"""The free rules a learned stop head is judged against in decoding, and how a report names each."""
TRANSFORMERS_MAX_DRAFT = 20  # num_assistant_tokens in transformers 5.x
BATCH_POLICIES = ("budget", "smartspec", "goodput", "dcut", "vllm_adaptive")


def make_policy(name: str, threshold: float, max_draft: int = 8) -> StopPolicy:
    """The rule `name` at `threshold` (K for constant_k); an unknown name lists the known ones. SPRINTER's rule has
    no cap: it drafts until its verifier flags a candidate."""
    if name not in RULES:
        raise UsageError(f"unknown decoding rule {name!r}; known: {', '.join(RULES)}")
    if name == "constant_k":
        return ConstantK(threshold=threshold, max_draft=int(threshold))
    if name == "sprinter":
        return SprinterRule(threshold=threshold)
    if name == "smartspec":
        return SmartSpecK(threshold=threshold, max_draft=max_draft)
    if name == "transformers":
        return TransformersDefault(threshold=threshold, max_draft=TRANSFORMERS_MAX_DRAFT)
    if name == "transformers_heuristic":
        if threshold < 1 or threshold != int(threshold):
            raise UsageError(f"the heuristic schedule starts at a whole number of candidates >= 1, got {threshold}")
        return TransformersHeuristicK(threshold=threshold)
    return RULES[name](threshold=threshold, max_draft=max_draft)
