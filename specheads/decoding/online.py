"""Decoding rules that adapt at run time, from outcomes the decode has already observed (never the future).

- `VllmEstimator`: vLLM's online acceptance estimator (vllm-project/vllm PR #52228, `acceptance_estimator.py`):
  p_k = σ(w · f + b_k) with f = logit(q(ŷ)) of the drawn candidate (clamped to ±40), one slope shared across
  positions and one intercept per position; refitted every 100 steps by damped Newton (IRLS) on the outcomes of the
  last 100 steps (L2 1e-3, the new fit blended in with weight n / (n + 50) for n samples, start w = 0, b = 1.5),
  with full verification (drafting to the cap) during the first 3 refits. Here it drives a stop rule: end the round
  once 1 − Π p_k exceeds the threshold (tuned on dev prompts). A step is one row's round (vLLM's step at batch 1).
- `TransformersConfidence`: transformers' assisted generation as users get it (5.x `candidate_generator.py`):
  stop drafting when q(ŷ) falls below the confidence threshold (0.4 at first) or at a stop token, at most 20
  candidates and one fewer than the tokens left (`min(20, max_length − length − 1)` there); after every
  round the threshold is re-tuned from the request's drafted tokens and outcomes by an ROC with cost fpr + 3 · fnr,
  once they hold more than 5 tokens of both classes. History and threshold are the request's: transformers 5.x builds
  its candidate generator for each `generate` call and tunes a copy of the assistant's generation config, so every
  request starts again from 0.4.
- `AdaEdl`: AdaEDL (Agrawal et al. 2024, arXiv 2410.18351): stop drafting once the entropy-based lower bound on
  the candidate's acceptance, 1 − sqrt(γ · H(q)) with γ = 0.2, falls below λ, with λ adapted at run time from the
  request's recent acceptance. The paper's own λ update is in no source this project can reach, so the adaptation
  here is ours and named as such: λ_t = λ − δ_t, where δ_t is an exponential moving average (rate 0.1 per checked
  candidate, from 0) of (accepted − bound) over the request's checked candidates, i.e. how loose the bound has been
  on this request lately. A loose bound (a request the target accepts more often than the bound says) lowers λ and
  drafts longer; δ = 0 is SVIP's rule under another name (1 − sqrt(γ H) < λ ⟺ sqrt(H) > (1 − λ)/sqrt(γ)).
- `TransformersHeuristic`: transformers' older default schedule, `num_assistant_tokens_schedule="heuristic"` with
  `num_assistant_tokens=5` and no confidence threshold: draft K candidates (ending at a stop token, at most one fewer
  than the tokens left, as transformers drafts), K + 2 after a round whose candidates were all accepted (a round with
  none counts as such, as there), otherwise max(1, K − 1). K is the request's (the candidate generator's, made
  anew by each `generate` call, from 5 again).
- `SglangAdaptive`: SGLang's adaptive `speculative_num_steps` (sgl-project/sglang PR #21599,
  `python/sglang/srt/speculative/adaptive_spec_params.py` as that PR added it, `AdaptiveSpeculativeParams`): one K
  for the whole server, chosen among the candidate steps 1, 3, 7. K starts at the candidate nearest the configured
  number of steps (ties: the larger) and an exponential moving average of accepted lengths at K − 1. After every
  verify step the average takes in the batch's mean accepted length (accepted draft tokens per request, the bonus
  token not counted): ema ← 0.8 · ema + 0.2 · mean. The first 10 steps only warm the average up; from then on, every
  5th step K moves down a candidate while ema ≤ (the next lower candidate) − 0.5 − 0.25 and otherwise up while
  ema > K − 0.5 (hysteresis −0.25 down, 0 up), so K settles one candidate above what is being accepted. The state is
  the server's, shared by all requests and kept from one request to the next; K is the round's cap for every row,
  known before the round drafts.

Each rule that runs one of these is defined here, beside its planner, and registers itself in
`specheads.decoding.rules.RULES`.

H(q) is known before the candidate is drawn, so AdaEDL's bound could even rank positions; vLLM's and transformers'
scores read the drawn token (q(ŷ)), so they may end a row's drafting (exact) but not rank drafted positions
for a verify budget (docs/decoding-core.md "Verify budgets").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from sklearn.metrics import roc_curve

from specheads.decoding.rules import Drafted, StopPolicy, register, require_whole

if TYPE_CHECKING:
    from specheads.decoding.costs import ServingCosts

LOGIT_CLAMP = 40.0


@dataclass(frozen=True)
class Outcome:
    """A checked candidate: its 1-based position in the round, the draft's probability of it, whether the target
    accepted it and the entropy of the draft's distribution it was drawn from (a round's outcomes end at its first
    rejection; later candidates have none)."""

    position: int
    prob: float
    accepted: bool
    entropy: float = 0.0  # H(q) at the step that drafted it


def drawn_logit(prob: float) -> float:
    """logit(q(ŷ)), clamped to ±40 (vLLM's feature)."""
    prob = min(max(prob, 0.0), 1.0)
    if prob <= 0.0:
        return -LOGIT_CLAMP
    if prob >= 1.0:
        return LOGIT_CLAMP
    return float(np.clip(math.log(prob) - math.log1p(-prob), -LOGIT_CLAMP, LOGIT_CLAMP))


class PassivePlanner:
    """The hooks a planner offers the round engine, doing nothing (`specheads.decoding.planners` has the batch ones)."""

    def admit(self, row: int) -> None:
        """A new request takes `row`."""

    def price_head(self, head_cost: float) -> None:
        """The head the rule reads costs `head_cost` (h) draft forwards a scored token (`head_forward_cost`); told once
        a decode, before its first round, and only where a head scores. Planners that plan on costs add its forwards
        to a candidate's price; the rest, and every planner of a free signal, pay nothing."""

    def price_draft(self, block: int | None, candidate: float = 0.0) -> None:
        """The draft's forward shape (`specheads.decoding.costs.ServingCosts.block`): None, one forward a candidate; n,
        one forward over a block of n slots a round, however many of its candidates are used; and `candidate`, what it
        computes for each candidate after its forward in draft forwards (a DSpark drafter's Markov bias). Told once a
        decode, before its first round; the planners that plan on the draft's costs price its forwards so."""

    def round_cap(self, rows: int, cap: int) -> int:
        return cap

    def stops(self, row: int, drafted: Drafted) -> bool:
        return False

    def verify_lengths(self, rounds: Mapping[int, list[Drafted]]) -> dict[int, int] | None:
        """How many of each row's drafted candidates (a prefix) the target checks; None: all of them."""
        return None

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        """The round's checked candidates per row."""


class VllmEstimator(PassivePlanner):
    """vLLM's online acceptance estimator as a stop rule (module docstring)."""

    def __init__(self, threshold: float, positions: int, window: int = 100, refit_every: int = 100,
                 warmup_refits: int = 3, l2: float = 1e-3, damping: float = 50.0, newton_steps: int = 10):
        self.threshold, self.positions = threshold, positions
        self.window: deque[list[tuple[float, int, bool]]] = deque(maxlen=window)
        self.refit_every, self.warmup_refits, self.l2, self.damping = refit_every, warmup_refits, l2, damping
        self.newton_steps = newton_steps
        self.theta = np.concatenate([[0.0], np.full(positions, 1.5)])  # w, b_1..b_K
        self.steps = self.refits = 0
        self.product: dict[int, float] = {}

    def probability(self, drafted: Drafted) -> float:
        """p_k of a drafted candidate."""
        position = min(drafted.index, self.positions)
        z = float(np.clip(self.theta[0] * drawn_logit(drafted.prob) + self.theta[position], -LOGIT_CLAMP, LOGIT_CLAMP))
        return 1.0 / (1.0 + math.exp(-z))  # clamped: a fit on one-sided outcomes may run its weights far out

    def stops(self, row: int, drafted: Drafted) -> bool:
        previous = 1.0 if drafted.index == 1 else self.product.get(row, 1.0)
        self.product[row] = previous * self.probability(drafted)
        return self.refits >= self.warmup_refits and 1.0 - self.product[row] > self.threshold

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        for checked in outcomes.values():
            self.window.append([(drawn_logit(o.prob), min(o.position, self.positions), o.accepted) for o in checked])
            self.steps += 1
            if self.steps % self.refit_every == 0:
                self.refit()

    def refit(self) -> None:
        """Damped Newton on the window's outcomes, blended into the current parameters with weight n / (n + 50)."""
        samples = [sample for step in self.window for sample in step]
        self.refits += 1
        if not samples:
            return
        features = np.zeros((len(samples), 1 + self.positions))
        features[:, 0] = [f for f, _, _ in samples]
        features[np.arange(len(samples)), [k for _, k, _ in samples]] = 1.0
        labels = np.array([float(y) for _, _, y in samples])
        theta = self.theta.copy()
        for _ in range(self.newton_steps):
            p = 1.0 / (1.0 + np.exp(-np.clip(features @ theta, -LOGIT_CLAMP, LOGIT_CLAMP)))
            gradient = features.T @ (p - labels) + self.l2 * theta
            hessian = (features * (p * (1 - p))[:, None]).T @ features + self.l2 * np.eye(len(theta))
            theta -= np.linalg.solve(hessian, gradient)
        weight = len(samples) / (len(samples) + self.damping)
        self.theta = self.theta + weight * (theta - self.theta)


class TransformersConfidence(PassivePlanner):
    """transformers' confidence threshold, re-tuned by ROC from each request's own history (module docstring); every
    request starts from `threshold`."""

    def __init__(self, threshold: float = 0.4):
        self.start = threshold
        self.threshold: dict[int, float] = {}
        self.history: dict[int, tuple[list[float], list[int]]] = {}

    def admit(self, row: int) -> None:
        self.threshold[row], self.history[row] = self.start, ([], [])

    def stops(self, row: int, drafted: Drafted) -> bool:
        return drafted.prob < self.threshold.get(row, self.start)

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        for row, checked in outcomes.items():
            probs, matches = self.history.setdefault(row, ([], []))
            probs += [o.prob for o in checked]
            matches += [int(o.accepted) for o in checked]
            if len(probs) > 5 and {0, 1} <= set(matches):
                fpr, tpr, thresholds = roc_curve(matches, probs)
                self.threshold[row] = float(min(thresholds[np.argmin(fpr + 3 * (1 - tpr))], 1.0))


ADAEDL_GAMMA = 0.2
"""AdaEDL's γ in the bound 1 − sqrt(γ · H(q)) (the paper's default)."""


def adaedl_bound(entropy: float, gamma: float = ADAEDL_GAMMA) -> float:
    """AdaEDL's entropy-based lower bound on a candidate's acceptance, 1 − sqrt(γ · H(q))."""
    return 1.0 - math.sqrt(gamma * max(entropy, 0.0))


class AdaEdl(PassivePlanner):
    """AdaEDL's stop rule with λ adapted from each request's recent acceptance (module docstring); every request
    starts from `threshold` (λ) with δ = 0."""

    def __init__(self, threshold: float, rate: float = 0.1, gamma: float = ADAEDL_GAMMA):
        self.threshold, self.rate, self.gamma = threshold, rate, gamma
        self.slack: dict[int, float] = {}

    def admit(self, row: int) -> None:
        self.slack[row] = 0.0

    def estimate(self, row: int, entropy: float) -> float:
        """The bound adapted to `row`'s request, 1 − sqrt(γ · H) + δ, for a candidate drawn from q of entropy H."""
        return adaedl_bound(entropy, self.gamma) + self.slack.get(row, 0.0)

    def stops(self, row: int, drafted: Drafted) -> bool:
        return self.estimate(row, drafted.entropy) < self.threshold

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        for row, checked in outcomes.items():
            slack = self.slack.get(row, 0.0)
            for o in checked:
                slack += self.rate * (float(o.accepted) - adaedl_bound(o.entropy, self.gamma) - slack)
            self.slack[row] = slack


class TransformersHeuristic(PassivePlanner):
    """transformers' `heuristic` draft-length schedule (module docstring); every request starts from `start`."""

    def __init__(self, start: int = 5):
        self.start = start
        self.k: dict[int, int] = {}

    def admit(self, row: int) -> None:
        self.k[row] = self.start

    def stops(self, row: int, drafted: Drafted) -> bool:
        return drafted.index >= self.k.get(row, self.start)

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        for row, checked in outcomes.items():  # a round with no candidate (one token left) matched all of its none
            k = self.k.get(row, self.start)
            self.k[row] = k + 2 if all(o.accepted for o in checked) else max(1, k - 1)


TRANSFORMERS_MAX_DRAFT = 20  # num_assistant_tokens in transformers 5.x


@register
@dataclass(frozen=True)
class VllmOnline(StopPolicy):
    """vLLM's online acceptance estimator (`VllmEstimator`) as a stop rule: end the round
    once 1 − Π p_k exceeds `threshold`; it drafts to the cap until its third refit."""

    name: ClassVar[str] = "vllm_online"

    def planner(self, costs: ServingCosts | None) -> Any:
        return VllmEstimator(self.threshold, self.max_draft or 8)


@register
@dataclass(frozen=True)
class AdaEdlRule(StopPolicy):
    """AdaEDL (`AdaEdl`): stop once the entropy bound 1 − sqrt(0.2 · H(q)) falls below λ
    (`threshold`, where each request starts), λ adapted from the request's recent acceptance."""

    name: ClassVar[str] = "adaedl"

    def planner(self, costs: ServingCosts | None) -> Any:
        return AdaEdl(self.threshold)


@dataclass(frozen=True)
class AssistedGeneration(StopPolicy):
    """Base of transformers' assisted-generation rules: its assistant stops drafting at a stop token."""

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return drafted.ends_output


@register
@dataclass(frozen=True)
class TransformersDefault(AssistedGeneration):
    """transformers' assisted generation as users get it (`TransformersConfidence`): the
    confidence rule from `threshold` (0.4), re-tuned by ROC at run time, at most `max_draft` (20) candidates and one
    fewer than the tokens left (`cap`), ending at a stop token as its assistant does."""

    name: ClassVar[str] = "transformers"

    @classmethod
    def make(cls, threshold: float, max_draft: int = 8) -> StopPolicy:
        return cls(threshold=threshold, max_draft=TRANSFORMERS_MAX_DRAFT)  # transformers' own cap, not the caller's

    def planner(self, costs: ServingCosts | None) -> Any:
        return TransformersConfidence(self.threshold)


@register
@dataclass(frozen=True)
class TransformersHeuristicK(AssistedGeneration):
    """transformers' older default, the `heuristic` schedule (`TransformersHeuristic`):
    `threshold` candidates at first (5), + 2 after a fully accepted round, else − 1 (at least 1); no cap but one
    fewer than the tokens left to generate (`cap`)."""

    max_draft: int | None = None
    name: ClassVar[str] = "transformers_heuristic"

    @classmethod
    def make(cls, threshold: float, max_draft: int = 8) -> StopPolicy:
        require_whole(threshold, "the heuristic schedule's first number of candidates")
        return cls(threshold=threshold)  # no cap of its own, as transformers drafts

    def planner(self, costs: ServingCosts | None) -> Any:
        return TransformersHeuristic(int(self.threshold))


SGLANG_CANDIDATE_STEPS = (1, 3, 7)
"""The draft lengths SGLang's adaptive rule chooses among (PR #21599's default `candidate_steps`)."""
SGLANG_START = 3
"""The K it starts from here: SGLang's own default of `speculative_num_steps` for a chain drafter."""


class SglangAdaptive(PassivePlanner):
    """SGLang's adaptive draft length: an EMA of accepted lengths sets the next rounds' K (module docstring)."""

    def __init__(self, start: int = SGLANG_START, candidates: tuple[int, ...] = SGLANG_CANDIDATE_STEPS,
                 alpha: float = 0.2, update_interval: int = 5, warmup: int = 10, down_hysteresis: float = -0.25,
                 up_hysteresis: float = 0.0):
        self.candidates = sorted(set(candidates))
        self.alpha, self.update_interval, self.warmup = alpha, update_interval, warmup
        self.down_hysteresis, self.up_hysteresis = down_hysteresis, up_hysteresis
        self.k = min(self.candidates, key=lambda step: (abs(step - start), -step))
        self.ema = float(self.k - 1)  # SGLang's neutral start: one fewer than the candidates drafted
        self.steps = 0

    def round_cap(self, rows: int, cap: int) -> int:
        return min(cap, self.k)

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        lengths = [sum(o.accepted for o in checked) for checked in outcomes.values() if checked]
        if not lengths:  # no row drafted (each had one token left): no verify of drafts to learn from
            return
        self.ema = (1 - self.alpha) * self.ema + self.alpha * sum(lengths) / len(lengths)
        self.steps += 1
        if self.steps > self.warmup and (self.steps - self.warmup) % self.update_interval == 0:
            self.k = self.next_k()

    def next_k(self) -> int:
        """K from the average: down a candidate while ema ≤ lower − 0.5 + down_hysteresis, else up while
        ema > K − 0.5 + up_hysteresis."""
        at = self.candidates.index(self.k)
        while at > 0 and self.ema <= self.candidates[at - 1] - 0.5 + self.down_hysteresis:
            at -= 1
        while at < len(self.candidates) - 1 and self.ema > self.candidates[at] - 0.5 + self.up_hysteresis:
            at += 1
        return self.candidates[at]


@register
@dataclass(frozen=True)
class SglangAdaptiveRule(StopPolicy):
    """SGLang's adaptive draft length (`SglangAdaptive`) as a rule: every row of a round drafts the server's current
    K (1, 3 or 7, at most `max_draft` and the tokens left), set from past rounds only. `threshold` is the number of
    steps it starts from (`speculative_num_steps`; 3 is SGLang's default), moved to the nearest candidate."""

    name: ClassVar[str] = "sglang_adaptive"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_whole(self.threshold, "the sglang_adaptive rule's first number of draft steps")

    def planner(self, costs: ServingCosts | None) -> Any:
        return SglangAdaptive(int(self.threshold))
