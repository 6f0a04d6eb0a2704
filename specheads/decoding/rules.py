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

Rules that keep state hand the engine a planner (`StopPolicy.planner`): the rules that adapt at run time
(`specheads.decoding.online`), the stop rule read from the costs (`specheads.decoding.cost_rule`) and the batch-level
rules (`budget`, `smartspec`, and the goodput planner read by a head, `goodput`, or by a free signal, `dcut` and
`vllm_adaptive`: `specheads.decoding.planners`), whose planner sees the whole round: how far every row may draft, and
how many of each row's candidates the target checks; and the rules on estimates refitted while serving (vLLM's merged
estimator, a per-request history, llama.cpp's p_min, a head calibrated online: `specheads.decoding.calibration`).

This module is the bottom of the decoding rules: what a rule sees (`Drafted`), the base of every rule, the rules that
need no state, and the registry `RULES`. Each of the modules above defines its rules beside the planners they run and
registers them (`register`), so imports go one way: rules ← online ← cost_rule ← planners ← calibration. A new rule is one class,
registered in `RULES`; the round engine (`specheads.decoding.engine`) runs any of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from specheads.heads.roles import CHAIN_HEADS, VERIFIER, check_role
from specheads.plumbing.errors import UsageError

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
    margin: float = 0.0  # the top-2 logit margin of that q (`top_two_margin`): known before the draw
    drafter_score: float | None = None  # the draft's own prediction of the candidate's acceptance (a DSpark drafter's
    # confidence head, `BatchCache.drafter_score`): known before the draw; None for a draft that makes none
    drafter_score_scaled: float | None = None  # the same through the drafter's per-position temperatures, as SGLang
    # applies them (`BatchCache.drafter_score_scaled`); None where the draft was given none
    proposal: Any = None  # a free draft's proposal this round (`specheads.lookup.proposers.Proposal`: its tokens,
    # the match's length, count and distance, the per-token scores, the source), known before the round drafts; the
    # candidate is its token number `index`. None under a draft model


RULES: dict[str, type[StopPolicy]] = {}
"""Every decoding rule by name, each registered where it is defined (`register`). Importing any module of
`specheads.decoding` imports the package first, and the package imports every module that defines rules, so the
registry is whole wherever a rule is looked up."""


def register(rule: type[StopPolicy]) -> type[StopPolicy]:
    """Class decorator: add `rule` to `RULES` under its `name`."""
    RULES[rule.name] = rule
    return rule


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
    reads_drafter_score: ClassVar[bool] = False  # reads the drafter's own prediction (`Drafted.drafter_score`)
    reads_drafter_temperatures: ClassVar[bool] = False  # reads it through the drafter's temperatures (`drafter_score_scaled`)

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

    def proposal_length(self, proposal: Any, estimates: Sequence[float] | None) -> int:
        """How many of a free draft's proposed tokens this round verifies (a prefix; 0: a plain target step), read
        from the whole proposal before any of it is drafted: its tokens and match statistics
        (`specheads.lookup.proposers.Proposal`) and, where the rule's planner keeps them, the conditional acceptance
        estimate â_k of each proposed token (`specheads.decoding.free_draft.FreePlanner.estimates`). Exact whatever it
        reads: every proposed token is a function of the verified context (docs/method.md, "Free drafts"). A rule
        without a choice of its own takes all of it (its cap and `stop` still end the round)."""
        return len(proposal.tokens)

    def planner(self, costs: ServingCosts | None) -> Any:
        """The planner that keeps the rule's state over a decode (the hooks of
        `specheads.decoding.online.PassivePlanner`); None for a rule that needs none."""
        return None

    @classmethod
    def make(cls, threshold: float, max_draft: int = 8) -> StopPolicy:
        """The rule at `threshold`, drafting at most `max_draft` candidates a round (`make_policy`)."""
        return cls(threshold=threshold, max_draft=max_draft)

    reads_companion: ClassVar[bool] = False  # SV's companion predictor scores the candidates
    head_roles: ClassVar[tuple[str, ...]] = CHAIN_HEADS  # what the head it reads was trained for (`specheads.heads.roles`)

    def check_head(self, head: Any) -> None:
        """Refuse a head this rule cannot use: none where it reads one, or one trained for another role."""
        if not self.reads_head:
            return
        if head is None:
            raise UsageError(f"the {self.name} rule needs an acceptance head")
        check_role(head, self.head_roles, f"the {self.name} rule")


def require_whole(threshold: float, what: str) -> None:
    """Refuse a rule value that is not a whole number >= 1; `what` says what the value is, e.g. "constant K"."""
    if threshold < 1 or threshold != int(threshold):
        raise UsageError(f"{what} must be a whole number >= 1, got {threshold}")


@register
@dataclass(frozen=True)
class ConstantK(StopPolicy):
    """Always K candidates per round (the usual default of speculative decoding)."""

    name: ClassVar[str] = "constant_k"

    def __post_init__(self) -> None:
        require_whole(self.threshold, "constant K")

    @classmethod
    def make(cls, threshold: float, max_draft: int = 8) -> StopPolicy:
        return cls(threshold=threshold, max_draft=int(threshold))

    def stop(self, drafted: Drafted) -> bool:
        return drafted.index >= int(self.threshold)


@register
@dataclass(frozen=True)
class Svip(StopPolicy):
    """SVIP: stop when sqrt(H(q)) > h at the step that drafted the candidate."""

    name: ClassVar[str] = "svip"

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return math.sqrt(max(drafted.entropy, 0.0)) > self.threshold


@register
@dataclass(frozen=True)
class Confidence(StopPolicy):
    """Draft confidence (transformers' assisted generation): stop when q(ŷ) < h."""

    name: ClassVar[str] = "confidence"

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return drafted.prob < self.threshold


@register
@dataclass(frozen=True)
class HeadStop(StopPolicy):
    """SpecDec++: stop when the predicted chance of at least one rejection, 1 − Π â, exceeds h."""

    name: ClassVar[str] = "head"
    reads_head: ClassVar[bool] = True

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return 1.0 - drafted.acceptance > self.threshold


@register
@dataclass(frozen=True)
class SvCompanionStop(HeadStop):
    """SV's companion predictor as a stop rule (`specheads.decoding.companion`): the companion runs beside the draft
    and scores each candidate when it is drafted; the head's rule on those scores, stop when 1 − Π p̂ exceeds h. Its
    prediction reads the drawn token, so it ends drafting (exact) and never ranks drafted positions. Each companion
    forward is counted at its cost in draft forwards (`specheads.decoding.companion.forward_cost`)."""

    name: ClassVar[str] = "sv_companion"
    reads_head: ClassVar[bool] = False
    reads_companion: ClassVar[bool] = True


@register
@dataclass(frozen=True)
class Oracle(StopPolicy):
    """The hindsight oracle of SpecDec++ Theorem 4.1: stop just before the first candidate the target rejects.

    It drafts up to the cap and counts only the accepted candidates as drafted, and one draft forward for each of
    them (what it would have spent had it known), so it never discards a token; the target's call then yields the
    token at the first rejection (exact, as in a normal round). eval reads the same accounting off constant K_max.
    """

    name: ClassVar[str] = "oracle"
    hindsight: ClassVar[bool] = True


@register
@dataclass(frozen=True)
class SprinterRule(StopPolicy):
    """SPRINTER: draft until the verifier scores a candidate below `threshold` (or the output ends); the target
    checks only that candidate (accept, or resample from norm(max(0, p − q))), the earlier ones stand unverified,
    and a round whose candidates all passed calls no target. No bonus token: the next round drafts as usual."""

    max_draft: int | None = None
    name: ClassVar[str] = "sprinter"
    reads_head: ClassVar[bool] = True
    head_roles: ClassVar[tuple[str, ...]] = (VERIFIER,)
    bonus: ClassVar[bool] = False

    @classmethod
    def make(cls, threshold: float, max_draft: int = 8) -> StopPolicy:
        return cls(threshold=threshold)  # no cap: it drafts until its verifier flags a candidate

    def stop(self, drafted: Drafted) -> bool:
        return self.flags(drafted) or drafted.ends_output

    def flags(self, drafted: Drafted) -> bool:
        """True when the verifier sends this candidate to the target."""
        return drafted.score < self.threshold

    def verify_from(self, round_: list[Drafted]) -> int | None:
        return len(round_) - 1 if self.flags(round_[-1]) else None


STOP_POLICIES = ("constant_k", "svip", "confidence", "head", "head_cost", "oracle", "vllm_online", "adaedl", "transformers",
                 "transformers_heuristic", "sglang_adaptive", "sv_companion", "vllm_current", "vllm_margin", "vllm_history",
                 "pmin", "head_cost_online", "dspark_confidence", "dspark_confidence_ts")
ONLINE_POLICIES = ("vllm_online", "adaedl", "transformers", "transformers_heuristic", "sglang_adaptive", "vllm_current",
                   "vllm_margin", "vllm_history", "head_cost_online")
BASELINES = {"constant_k": "the best constant K", "svip": "SVIP at its best threshold",
             "confidence": "draft confidence at its best threshold",
             "vllm_online": "vLLM's online acceptance estimator at its best threshold",
             "adaedl": "AdaEDL's entropy bound, λ adapted from recent acceptance, at its best starting λ",
             "transformers": "transformers' assisted-generation default (confidence 0.4, re-tuned by ROC)",
             "transformers_heuristic": "transformers' older heuristic schedule (K from 5, +2 / −1)",
             "sglang_adaptive": "SGLang's adaptive draft length (an EMA of accepted lengths picks K among 1, 3, 7; from 3)",
             "sv_companion": "SV's companion predictor at its best threshold (its forwards counted at their cost in draft "
                             "forwards)",
             "vllm_current": "vLLM's online acceptance estimator as merged (logit(max q), no warm-up) at its best threshold",
             "vllm_margin": "vLLM's estimator on the top-2 logit margin, full blocks verified until its third refit, at its "
                            "best threshold",
             "vllm_history": "each request's own acceptance by position (a per-request history) at its best threshold",
             "pmin": "llama.cpp's p_min (the candidate with max q below it ends the round unchecked) at its best p_min"}
"""The free rules a learned stop head is judged against in decoding, and how a report names each."""
DRAFTER_BASELINES = {"dspark_confidence": "the DSpark drafter's own confidence head at its best p_min (llama.cpp's stop)",
                     "dspark_confidence_ts": "the same head through its per-position temperatures (DeepSpec's and SGLang's "
                                             "temperature scaling) at its best p_min"}
"""The rules reading a drafter's own prediction that a head is judged against where the drafter drafts (--dspark)."""
BATCH_POLICIES = ("budget", "smartspec", "goodput", "dcut", "vllm_adaptive", "vllm_current_adaptive", "vllm_margin_adaptive",
                  "vllm_history_adaptive", "goodput_online", "dspark_adaptive", "dspark_adaptive_ts")
FREE_DRAFT_RULES = ("lookup_match", "suffix_own", "lookup_table", "lookup_scores", "lookup_plan", "lookup_plan_online")
"""The rules of free drafts (prompt lookup, suffix: `specheads.decoding.free_rules`), which read the whole proposal."""


def make_policy(name: str, threshold: float, max_draft: int = 8) -> StopPolicy:
    """The rule `name` at `threshold` (K for constant_k), drafting at most `max_draft` candidates a round where the
    rule has a cap (SPRINTER's has none: it drafts until its verifier flags a candidate); an unknown name lists the
    known ones."""
    if name not in RULES:
        raise UsageError(f"unknown decoding rule {name!r}; known: {', '.join(RULES)}")
    if not math.isfinite(threshold) or threshold < 0:  # every rule's value is a probability, entropy, K, c or count
        raise UsageError(f"the {name} rule's threshold must be a finite number >= 0, got {threshold}")
    return RULES[name].make(threshold, max_draft)
