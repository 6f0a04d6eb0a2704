"""Acceptance estimates that calibrate themselves while serving: vLLM's current online estimator, a per-request
history, llama.cpp's p_min stop, and a trained head calibrated online from verify outcomes (issue 62).

**vLLM's online acceptance estimator as merged** (vllm-project/vllm PR #52228, "Acceptance estimation for adaptive
verification"; `vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py`, read in its merged form: the PR's own
description says "the feature used is `logit(max q)`", and its benchmark notes that the 300-step warm-up "has since
been removed"). `OnlineLogistic` is its fit; `MAX_LOG_ODDS_START` its cold start:
- p_k = σ(w · f_k + b_k), f_k = logit(max q_k), the log-odds of the draft distribution's most likely token (clamped
  to ±40), a property of q_k and so known before the draw; one slope shared across draft positions, one intercept per
  position; cold start w = 0.5, b_k = −0.2 (vLLM's median over five served models).
- Every step (one batch round here) folds the graded drafts into sufficient statistics, each at the prediction made
  when it was drafted: position k of a request is observed only when its chain reached k and k was verified (the
  accepted drafts and the first rejection, vLLM's `step <= num_accepted & step < num_admitted`), labelled 1 when
  accepted. Nothing else is stored.
- Every 100 steps, one Newton-IRLS step from that window's statistics alone, then the statistics are cleared ("each
  refit is a fit over its own window, which is also what makes the estimator track workload drift"): with the
  intercepts profiled out of the arrowhead XᵀWX, the slope's step is (g₀ − Σ_k b_k g₁ₖ / c_k) / (a − Σ_k b_k² / c_k)
  (ridge 10⁻³ on a and every c_k), damped by n / (n + 50) over the window's n observations and dropped where it is
  not finite or would make the slope negative; each intercept's step is (g₁ₖ − b_k Δw) / c_k, damped by its own
  n_k / (n_k + 50) (a position nobody reached holds still).
- Trimming starts at once: no warm-up (`warmup_refits` 0).
With several features (the head's logit and the margin, below) the slope is a vector and the profiled step a small
linear solve; with one feature it is vLLM's formula exactly.

**The PR's earlier revision, as issue 62 describes the estimator**: the feature was the top-2 logit margin m₁ − m₂
(`Drafted.margin`; its docstring: held-out AUC 0.884 against 0.839 for DeepSeek-V4-Flash-DSpark's trained confidence
head), cold start w = 0, b = 1.5, and whole draft blocks verified until its third refit so that its own trimming does
not censor its labels (`VLLM_AE_WARMUP_REFITS`, 3). That revision fitted a slope and an intercept per position with
an undamped 2 × 2 Newton step gated at 50 observations a round; `vllm_margin` keeps its feature, start and warm-up
and fits as the merged estimator does (shared slope, damped steps), so that the two differ by feature and warm-up.

**A per-request history** (`HistorySignal`): a_j of a request's position j is the share of its candidates at j that
were reached and verified and then accepted, counted over the request's earlier rounds only (the censoring above),
with a prior of `SIGNAL_PRIOR` (0.7) worth two observations; a new request starts again from the prior. Issue 62
names this as vLLM's per-request "history" source; no vLLM source reachable here holds one (the estimator's
revisions, `adaptive_verification.py`, `confidence.py` and `dspark/online_sts.py` were read), so the definition is
the issue's and the prior is ours.

**llama.cpp's p_min** (`common/speculative.cpp`, `--draft-p-min`): the draft takes its most likely token and "only
collect[s] very high-confidence draft tokens": once that token's probability falls below p_min, drafting ends and
that token is dropped, not verified. Here drafts are drawn from q, so the rule reads max q_k (`Drafted.top1`, what
llama.cpp reads, known before the draw): the round ends at the first candidate with max q_k < p_min, and that
candidate, whose draft forward was spent, is not sent to the target (`PMinPlanner`). Exact: whether a candidate is
checked depends only on max q_k. In the goodput planner its signal, max q_j, is D-Cut's (`dcut`).

**A head that calibrates itself while serving** (`head_signal`): the trained head's logit, logit(â_k) (and, with
`with_margin`, the top-2 margin beside it), is the feature of the same online fit, per position, from the same
censored outcomes, starting from the identity (slope 1 on the head's logit, 0 on the margin, intercepts 0: the head's
own calibration until outcomes say otherwise). One estimator object serves every row of a decode (a server's
requests; eval's sweep carries it from one batch of a setting to the next), and it reads past outcomes only. It feeds
the stop rule read from the costs (`head_cost_online`: S_k and μ from the calibrated â) and the goodput planner
(`goodput_online`, with an expected-acceptance head, whose logit is known before the draw, so that ranking stays
exact). `audit_every` N > 0 drafts every N-th round to the cap and checks it whole (full width), so that positions
the rule would trim are still observed.

Each estimate registers itself in `specheads.decoding.planners.SIGNALS` (`vllm_current`, `vllm_margin`, `history`,
`head_online`) and each rule, defined here, in `specheads.decoding.rules.RULES`, naming the signal it reads; every
candidate's feature is
recorded when the engine hands the planner the round's drafts (`verify_lengths`, which checks all of them for a stop
rule), so the candidate that ends a round at the cap is observed too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from specheads.decoding.cost_rule import CostPlanner, HeadCostStop
from specheads.decoding.online import LOGIT_CLAMP, Outcome, PassivePlanner, drawn_logit
from specheads.decoding.planners import (
    SIGNAL_PRIOR,
    GoodputPlan,
    Signal,
    SignalReader,
    make_signal,
    register_signal,
)
from specheads.decoding.rules import Drafted, StopPolicy, register

if TYPE_CHECKING:
    from specheads.decoding.costs import ServingCosts

MAX_LOG_ODDS_START = (0.5, -0.2)
"""vLLM's cold start for logit(max q): slope 0.5, every intercept −0.2."""
MARGIN_REVISION_START = (0.0, 1.5)
"""The margin revision's cold start: slope 0, every intercept 1.5 (a uniform estimate of σ(1.5) = 0.82)."""
MARGIN_REVISION_WARMUP = 3
"""The margin revision's warm-up: whole blocks verified until its third refit."""


def sigmoid(value: float) -> float:
    """σ(value), the argument clamped to ±40."""
    value = min(max(value, -LOGIT_CLAMP), LOGIT_CLAMP)
    return 1.0 / (1.0 + math.exp(-value))


class OnlineLogistic:
    """vLLM's online per-position logistic fit (module docstring): p_k = σ(w · f + b_k), w shared across the
    `positions` (a vector for several features), refitted every `refit_every` steps from that window's statistics."""

    def __init__(self, positions: int, slopes: Sequence[float], intercept: float, refit_every: int = 100,
                 damping: float = 50.0, l2: float = 1e-3, warmup_refits: int = 0, audit_every: int = 0):
        self.positions, self.refit_every, self.damping, self.l2 = positions, refit_every, damping, l2
        self.warmup_refits, self.audit_every = warmup_refits, audit_every
        self.slopes = np.asarray(slopes, dtype=float)
        self.intercepts = np.full(positions, float(intercept))
        self.steps = self.refits = 0
        self.clear()

    def clear(self) -> None:
        """Start a new window of statistics: per position the coupling Σ w f, the intercept block Σ w, its score
        Σ (y − p) and count, and the slopes' block Σ w f fᵀ and score Σ (y − p) f, shared by every position."""
        width = len(self.slopes)
        self.coupling = np.zeros((self.positions, width))
        self.weight = np.zeros(self.positions)
        self.residual = np.zeros(self.positions)
        self.counts = np.zeros(self.positions)
        self.slope_block = np.zeros((width, width))
        self.slope_score = np.zeros(width)

    def slot(self, position: int) -> int:
        """The 0-based intercept of a 1-based round position (positions past the last share its intercept)."""
        return min(max(position, 1), self.positions) - 1

    def predict(self, features: Sequence[float], position: int) -> float:
        """p_k of a candidate at 1-based `position` with `features`."""
        return sigmoid(float(self.slopes @ np.asarray(features, dtype=float)) + self.intercepts[self.slot(position)])

    def predictions(self, features: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """p of each row of `features` [n, features] at its 0-based intercept `slots` [n]."""
        return 1.0 / (1.0 + np.exp(-np.clip(features @ self.slopes + self.intercepts[slots], -LOGIT_CLAMP, LOGIT_CLAMP)))

    @property
    def full_width(self) -> bool:
        """Whether the coming round drafts to its cap and checks everything: during the warm-up, and every
        `audit_every`-th round."""
        return self.refits < self.warmup_refits or (self.audit_every > 0 and self.steps % self.audit_every == 0)

    def fold(self, features: Sequence[Sequence[float]], positions: Sequence[int], accepted: Sequence[bool]) -> None:
        """Add graded drafts (one row of `features` each, their 1-based `positions` and outcomes) to the window, each
        at the prediction the current coefficients make (those it was drafted under: they change only at a refit,
        which comes after a step's drafts are folded)."""
        f = np.asarray(features, dtype=float).reshape(-1, len(self.slopes))
        if not len(f):
            return
        k = np.minimum(np.maximum(np.asarray(positions), 1), self.positions) - 1
        p = self.predictions(f, k)
        w, r = p * (1.0 - p), np.asarray(accepted, dtype=float) - p
        np.add.at(self.coupling, k, w[:, None] * f)
        np.add.at(self.weight, k, w)
        np.add.at(self.residual, k, r)
        np.add.at(self.counts, k, 1.0)
        self.slope_block += (f * w[:, None]).T @ f
        self.slope_score += f.T @ r

    def step(self) -> None:
        """End a step (a round of the batch); every `refit_every` steps, refit."""
        self.steps += 1
        if self.steps % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        """One damped Newton step from the window's statistics, the intercepts profiled out (module docstring)."""
        c = self.weight + self.l2
        schur = self.slope_block + self.l2 * np.eye(len(self.slopes)) - (self.coupling.T / c) @ self.coupling
        gradient = self.slope_score - (self.coupling.T / c) @ self.residual
        with np.errstate(all="ignore"):
            try:
                step = np.linalg.solve(schur, gradient)
            except np.linalg.LinAlgError:
                step = np.zeros_like(self.slopes)
            total = self.counts.sum()
            step *= total / (total + self.damping)
            step = np.where(np.isfinite(step) & (self.slopes + step >= 0.0), step, 0.0)
            intercept_step = (self.residual - self.coupling @ step) / c * self.counts / (self.counts + self.damping)
        self.slopes = self.slopes + step
        self.intercepts = self.intercepts + np.where(np.isfinite(intercept_step), intercept_step, 0.0)
        self.clear()
        self.refits += 1


Feature = Callable[[Drafted], tuple[float, ...]]
FEATURES: dict[str, Feature] = {
    "max_logodds": lambda d: (drawn_logit(d.top1),),
    "margin": lambda d: (d.margin,),
    "head": lambda d: (drawn_logit(d.score),),
    "head_margin": lambda d: (drawn_logit(d.score), d.margin),
}
"""What each online fit reads of a drafted candidate: logit(max q) (vLLM's merged feature), the top-2 margin (its
earlier revision's), the head's logit logit(â), or the head's logit and the margin."""


class EstimatorSignal(Signal):
    """An `OnlineLogistic` fit on one of `FEATURES`, as a goodput planner's signal and a stop rule's source; not
    `ready` while it drafts full width (its warm-up, an audit round)."""

    name: ClassVar[str] = "estimator"

    def __init__(self, fit: OnlineLogistic, feature: str):
        self.fit, self.feature = fit, FEATURES[feature]

    @property
    def ready(self) -> bool:
        return not self.fit.full_width

    def acceptance(self, drafted: Drafted) -> float:
        return self.fit.predict(self.feature(drafted), drafted.index)

    def observe(self, rounds: Mapping[int, list[Drafted]], outcomes: Mapping[int, list[Outcome]]) -> None:
        graded = [(rounds[row][o.position - 1], o) for row, checked in outcomes.items() for o in checked]
        self.fit.fold([self.feature(seen) for seen, _ in graded], [o.position for _, o in graded],
                      [o.accepted for _, o in graded])
        self.fit.step()


def vllm_signal(positions: int) -> EstimatorSignal:
    """vLLM's merged estimator: logit(max q), its cold start, no warm-up."""
    return EstimatorSignal(OnlineLogistic(positions, MAX_LOG_ODDS_START[:1], MAX_LOG_ODDS_START[1]), "max_logodds")


def margin_signal(positions: int) -> EstimatorSignal:
    """The top-2 margin with the PR's earlier revision's cold start and warm-up (full blocks verified until the third
    refit), fitted as the merged estimator fits (one damped slope shared across positions, refitted every window
    whatever its count), not as that revision did (a slope and an intercept per position, an undamped 2 × 2 Newton
    step, only with 50 observations): its feature, start and warm-up beside the merged estimator's, not a replica."""
    fit = OnlineLogistic(positions, MARGIN_REVISION_START[:1], MARGIN_REVISION_START[1],
                         warmup_refits=MARGIN_REVISION_WARMUP)
    return EstimatorSignal(fit, "margin")


def head_signal(positions: int, with_margin: bool = False, audit_every: int = 0) -> EstimatorSignal:
    """A trained head calibrated online: its logit (and the margin) fitted per position, from the identity."""
    slopes = (1.0, 0.0) if with_margin else (1.0,)
    return EstimatorSignal(OnlineLogistic(positions, slopes, 0.0, audit_every=audit_every),
                           "head_margin" if with_margin else "head")


class HistorySignal(Signal):
    """A request's own acceptance by position (module docstring): (accepted + 0.7 · 2) / (reached and verified + 2)
    over the request's earlier rounds."""

    name: ClassVar[str] = "history"

    def __init__(self, positions: int, prior: float = SIGNAL_PRIOR, weight: float = 2.0):
        self.positions, self.prior, self.weight = positions, prior, weight
        self.counts: dict[int, np.ndarray] = {}  # row -> [positions, (accepted, reached and verified)]

    def admit(self, row: int) -> None:
        self.counts[row] = np.zeros((self.positions, 2))

    def acceptance(self, drafted: Drafted) -> float:
        return self.prior

    def acceptance_at(self, row: int, drafted: Drafted) -> float:
        counts = self.counts.get(row)
        if counts is None:
            return self.prior
        accepted, trials = counts[min(drafted.index, self.positions) - 1]
        return (accepted + self.prior * self.weight) / (trials + self.weight)

    def observe(self, rounds: Mapping[int, list[Drafted]], outcomes: Mapping[int, list[Outcome]]) -> None:
        for row, checked in outcomes.items():
            counts = self.counts.setdefault(row, np.zeros((self.positions, 2)))
            for outcome in checked:
                counts[min(outcome.position, self.positions) - 1] += (float(outcome.accepted), 1.0)


@dataclass
class SignalStop(SignalReader):
    """A stop rule on a signal's survival product: a row's round ends once 1 − Π_{j≤k} a_j exceeds `threshold`; while
    the signal is not `ready` every row drafts to its cap. Every drafted candidate is checked, and the signal learns
    from them (`SignalReader`)."""

    signal: Signal
    threshold: float
    survival: dict[int, float] = field(default_factory=dict)
    rounds: dict[int, list[Drafted]] = field(default_factory=dict)

    def stops(self, row: int, drafted: Drafted) -> bool:
        _, survival = self.read(row, drafted)
        return self.signal.ready and 1.0 - survival > self.threshold


def top1_of(drafted: Drafted) -> float:
    """max q at the step that drafted the candidate (what llama.cpp's p_min reads)."""
    return drafted.top1


def drafter_score_of(drafted: Drafted) -> float:
    """The drafter's own prediction of the candidate's acceptance (a DSpark drafter's confidence head), made before
    its draw; 1.0 for a draft that makes none (`refuse_for_draft` refuses a rule reading it there)."""
    return 1.0 if drafted.drafter_score is None else drafted.drafter_score


def drafter_score_scaled_of(drafted: Drafted) -> float:
    """`drafter_score_of` through the drafter's per-position temperatures (`Drafted.drafter_score_scaled`); 1.0 where
    the draft was given none (`refuse_for_draft` refuses a rule reading it there)."""
    return 1.0 if drafted.drafter_score_scaled is None else drafted.drafter_score_scaled


class PMinPlanner(PassivePlanner):
    """llama.cpp's p_min: the candidate that ended a round with its `score` (max q, or a DSpark drafter's confidence)
    below `p_min` is not checked (module docstring)."""

    def __init__(self, p_min: float, score: Callable[[Drafted], float] = top1_of):
        self.p_min, self.score = p_min, score

    def verify_lengths(self, rounds: Mapping[int, list[Drafted]]) -> dict[int, int]:
        return {row: len(seen) - int(bool(seen) and self.score(seen[-1]) < self.p_min) for row, seen in rounds.items()}


@dataclass
class CalibratedCostPlanner(SignalReader, CostPlanner):
    """The stop rule read from the costs (`CostPlanner`) on the head's â calibrated online by `signal`: S_k and μ
    from the calibrated values (`SignalReader` reads and teaches the signal)."""

    signal: Signal | None = None
    survival: dict[int, float] = field(default_factory=dict)
    rounds: dict[int, list[Drafted]] = field(default_factory=dict)

    def stops(self, row: int, drafted: Drafted) -> bool:
        assert self.signal is not None
        acceptance, survival = self.read(row, drafted)
        stop = super().stops(row, replace(drafted, acceptance=survival, score=acceptance))
        return stop and self.signal.ready  # not ready: a full-width round, drafting on to the cap


for name, factory in (("vllm_current", vllm_signal), ("vllm_margin", margin_signal), ("history", HistorySignal),
                      ("head_online", head_signal)):
    register_signal(name, factory)


@dataclass(frozen=True)
class SignalStopRule(StopPolicy):
    """A stop rule on the survival product of a signal of `SIGNALS` (`SignalStop`): end the round once 1 − Π a_k
    exceeds `threshold`."""

    signal: ClassVar[str] = ""

    def planner(self, costs: ServingCosts | None) -> Any:
        return SignalStop(make_signal(self.signal, self.max_draft or 8), self.threshold)


@register
@dataclass(frozen=True)
class VllmCurrent(SignalStopRule):
    """vLLM's online acceptance estimator as merged (`vllm_signal`: σ(w · logit(max q_k) + b_k), refitted every 100
    rounds, no warm-up) as a stop rule."""

    name: ClassVar[str] = "vllm_current"
    signal: ClassVar[str] = "vllm_current"


@register
@dataclass(frozen=True)
class VllmMargin(SignalStopRule):
    """vLLM's merged estimator's fit on the top-2 logit margin with the earlier revision's start and three-refit
    warm-up (`margin_signal`: that revision's feature, start and warm-up, not its per-position undamped fit gated at
    50 observations) as a stop rule; it drafts to the cap until its third refit."""

    name: ClassVar[str] = "vllm_margin"
    signal: ClassVar[str] = "vllm_margin"


@register
@dataclass(frozen=True)
class VllmHistory(SignalStopRule):
    """The per-request history (`HistorySignal`) as a stop rule: a_j is the request's own acceptance at position j so
    far."""

    name: ClassVar[str] = "vllm_history"
    signal: ClassVar[str] = "history"


@register
@dataclass(frozen=True)
class PMin(StopPolicy):
    """llama.cpp's `--draft-p-min`: drafting ends at the first candidate whose max q is below `threshold`, and that
    candidate is not checked (`PMinPlanner`)."""

    name: ClassVar[str] = "pmin"
    score: ClassVar[Callable[[Drafted], float]] = staticmethod(top1_of)

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return self.score(drafted) < self.threshold

    def planner(self, costs: ServingCosts | None) -> Any:
        return PMinPlanner(self.threshold, self.score)


@register
@dataclass(frozen=True)
class DSparkConfidence(PMin):
    """llama.cpp's p_min on a DSpark drafter's confidence head (what llama.cpp stops a DSpark draft with): drafting
    ends at the first candidate whose confidence is below `threshold`, and that candidate is not checked. Exact, and
    free: the confidence of candidate k reads the block's slot and the token before k, not k, so it is known before k
    is drawn, and the drafter computed it in its block's forward (`Drafted.drafter_score`)."""

    name: ClassVar[str] = "dspark_confidence"
    reads_drafter_score: ClassVar[bool] = True
    score: ClassVar[Callable[[Drafted], float]] = staticmethod(drafter_score_of)


@register
@dataclass(frozen=True)
class DSparkConfidenceScaled(DSparkConfidence):
    """`dspark_confidence` on the confidence through the drafter's per-position temperatures (DeepSpec's temperature
    scaling, SGLang's table): σ(z / T_k) < p_min ends the round. Exact as the raw one: T_k depends on k alone."""

    name: ClassVar[str] = "dspark_confidence_ts"
    reads_drafter_temperatures: ClassVar[bool] = True
    score: ClassVar[Callable[[Drafted], float]] = staticmethod(drafter_score_scaled_of)


@register
@dataclass(frozen=True)
class HeadCostOnline(HeadCostStop):
    """The stop rule read from the costs (`head_cost`) on the head calibrated while serving (`head_signal`): draft one
    more candidate while S_k · μ, from the online-calibrated â, is worth its cost at the request's rate. `threshold` is
    c = t_draft/t_target."""

    name: ClassVar[str] = "head_cost_online"

    def planner(self, costs: ServingCosts | None) -> Any:
        return CalibratedCostPlanner(self.threshold, None if costs is None else costs.target,
                                     signal=head_signal(self.max_draft or 8))


@register
@dataclass(frozen=True)
class VllmCurrentAdaptive(GoodputPlan):
    """vLLM's adaptive verification fed its merged estimator (`vllm_signal`) in the goodput planner: exact, logit(max q)
    being known before the draw; it trims from the first round."""

    name: ClassVar[str] = "vllm_current_adaptive"
    reads_head: ClassVar[bool] = False
    signal: ClassVar[str] = "vllm_current"


@register
@dataclass(frozen=True)
class VllmMarginAdaptive(GoodputPlan):
    """The goodput planner fed the margin revision (`margin_signal`): every candidate checked until its third refit."""

    name: ClassVar[str] = "vllm_margin_adaptive"
    reads_head: ClassVar[bool] = False
    signal: ClassVar[str] = "vllm_margin"


@register
@dataclass(frozen=True)
class VllmHistoryAdaptive(GoodputPlan):
    """The goodput planner fed each request's own acceptance by position (`HistorySignal`): exact, it reads only
    earlier rounds."""

    name: ClassVar[str] = "vllm_history_adaptive"
    reads_head: ClassVar[bool] = False
    signal: ClassVar[str] = "history"


@register
@dataclass(frozen=True)
class GoodputOnline(GoodputPlan):
    """The goodput planner fed an expected-acceptance head calibrated while serving (`head_signal`): its logit α̂_j,
    known before the draw, refitted per position from verify outcomes."""

    name: ClassVar[str] = "goodput_online"
    signal: ClassVar[str] = "head_online"
