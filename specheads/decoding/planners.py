"""Batch-level planners: how much every row of a round drafts and how many of its candidates the target checks.

A stop rule decides for one row. In a batch the target checks every row's candidates in one forward, so what matters
is how many candidates of which rows go into it. A planner sees the whole round:
- `admit(row)`: a new request takes a row;
- `round_cap(rows)`: before drafting, the most candidates any row drafts this round;
- `stops(row, drafted)`: while drafting, whether a row's drafting ends after this candidate (beside the rule's stop);
- `verify_lengths(rounds)`: after drafting, from each row's drafted candidates (`Drafted`), how many of them (a
  prefix) the target checks;
- `observe(outcomes)`: the round's checked candidates and their outcomes, for planners that learn from them
  (`specheads.decoding.online` has the rules that adapt at run time).

Exactness (docs/decoding-core.md "Verify budgets"): speculative sampling stays exact when, for every row, whether
candidate ŷ_j is checked depends only on what was known before ŷ_j was drawn: the row's earlier candidates, other
rows (independent draws) and the past. `round_cap` reads only the past; `stops` only ends drafting, which any function
of the candidates drafted so far may do. `verify_lengths` ranks positions by the survival product
S_j = Π_{i≤j} α̂_i of an expected-acceptance head, which reads nothing of ŷ_i (`decides: before_draw`), so S_j is
known before ŷ_j is drawn; S is non-increasing along a row, so the greedy takes a prefix of each row, and whether
it reaches ŷ_j depends only on gains at least S_j: the row's earlier positions and other rows'.
The goodput `BudgetPlanner` maximises is SV's, (expected accepted + one per row) / t_target(tokens verified): the
round's draft time (the head's forwards with it) is left out of it, since it depends on how far each row drafted,
which depends on the row's later candidates. `GoodputPlanner` counts the draft's time without reading it: through the
goodput it plans before the round (K = 0, plain decoding, among its choices), which prices its drafting and checking,
and through the draft's curve at the round's B; a row's drafting reads only that row's candidates. Its signal
(`Signal`) is an expected-acceptance head, D-Cut's top-1 probability or vLLM's refitted estimate, all known before
the draw; the head's forward over each candidate is priced with the draft's (`PassivePlanner.price_head`, as
`round_seconds` prices it), the free signals' cost nothing.
Fed a score that has read ŷ_j (an `at_draft` head, q(ŷ_j)), the same planners are lossy (tests/test_budget.py and
tests/test_planners.py show by how much).

The batch-level rules that run these planners are defined at the end, each registered in
`specheads.decoding.rules.RULES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from specheads.decoding.cost_rule import worth_drafting
from specheads.decoding.costs import CostCurve, ServingCosts
from specheads.decoding.online import Outcome, PassivePlanner, VllmEstimator, drawn_logit
from specheads.decoding.rules import Drafted, StopPolicy, register, require_whole
from specheads.plumbing.errors import UsageError


class PlansOnCosts(PassivePlanner):
    """A planner that plans on the serving costs (`costs`), priced for the draft's forward shape once the engine
    tells it (`price_draft`: one forward a candidate, or one block a round)."""

    costs: ServingCosts

    def price_draft(self, block: int | None, candidate: float = 0.0) -> None:
        self.costs = self.costs.shaped(block, candidate)


def goodput_verify_lengths(survival: Mapping[int, list[float]], target: CostCurve) -> tuple[dict[int, int], float]:
    """SV's batch greedy: each row's verify length, from its candidates' survival products S_1 ≥ S_2 ≥ … .

    Start with no candidate checked (every row still gets the target's token: B tokens for t(B)); repeatedly add
    the position with the largest S (ties: lower row, earlier position) while the goodput
    (B + Σ chosen S) / t(B + chosen) does not fall; stop at the first that would lower it. t prices the forward on
    the round's B rows (`CostCurve.price`). Also returns the S of that first refused position (0 when none was
    refused): the marginal value a candidate needed this round."""
    lengths = {row: 0 for row in survival}
    rows = len(survival)
    tokens = value = float(rows)
    best = value / target.price(rows, rows) if survival else 0.0
    for negative, row, index in ranked_positions(survival):
        if index != lengths[row] + 1:  # never for a non-increasing S (the sort puts a row's positions in order)
            continue
        goodput = (value - negative) / target.price(int(tokens) + 1, rows)
        if goodput < best:
            return lengths, -negative
        tokens, value, best = tokens + 1, value - negative, goodput
        lengths[row] = index
    return lengths, 0.0


def ranked_positions(survival: Mapping[int, list[float]]) -> list[tuple[float, int, int]]:
    """Every drafted position as (−S, row, 1-based index), best survival first (ties: lower row, earlier position):
    the order in which the verify greedies take positions."""
    return sorted((-clean(score), row, index) for row, scores in survival.items() for index, score in enumerate(scores, 1))


def clean(score: float) -> float:
    """A survival in [0, 1]; a non-finite one (an overflowing head) counts as 0 so the sort stays a total order."""
    return min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0


class BudgetPlanner(PlansOnCosts):
    """The verify budget: every row drafts up to the cap, stopping early once its survival S_k falls below the
    marginal value the previous round's greedy refused (what a candidate had to be worth to be checked; the rule's
    floor when it refused none), then the target checks the prefixes `goodput_verify_lengths` chooses."""

    def __init__(self, costs: ServingCosts, floor: float = 0.0):
        self.costs, self.floor, self.cutoff = costs, floor, 0.0

    def stops(self, row: int, drafted: Drafted) -> bool:
        return drafted.acceptance < max(self.floor, self.cutoff)

    def verify_lengths(self, rounds: Mapping[int, list[Drafted]]) -> dict[int, int]:
        survival = {row: [drafted.acceptance for drafted in seen] for row, seen in rounds.items()}
        lengths, self.cutoff = goodput_verify_lengths(survival, self.costs.target)
        return lengths


@dataclass
class SmartSpecPlanner(PlansOnCosts):
    """SmartSpec's goodput K (Liu et al. 2024): one K for the whole batch each round, the one that maximises the
    modelled goodput B · Σ_{j=0..K} a^j / (Σ_{s≤K} t_draft(B) + t_target(B · (K + 1)) + a^K · catch-up(B)), with a
    the token acceptance rate estimated from the past rounds (an exponential average of accepted and rejected counts:
    a = accepted / (accepted + rejections), the geometric model's estimate), every forward priced on the round's B
    rows, and catch-up(B) what the round defers to the draft's next forward when its rows' last token goes unread
    (`ServingCosts.catch_up`: always at K = 0, where the draft does not run; at K ≥ 1 when every candidate is
    accepted). K = 0 is plain target decoding; its rounds check nothing, so the estimate drifts back to the prior and
    drafting is tried again. For a block drafter (`PlansOnCosts.price_draft`) the draft's K forwards are one block
    forward, and every emitted token is a context token of a later block (`ServingCosts.drafting`, `deferred_share`)."""

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
            deferred = deferred_share([rate**j for j in range(1, k + 1)], rows, k, rows * k,  # a^K: every one checked
                                      self.costs.block, expected - rows)
            return expected / (self.costs.drafting(rows, k) + self.costs.target.price(rows * (k + 1), rows)
                               + deferred * self.costs.catch_up(rows))

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


SIGNAL_PRIOR = 0.7
"""The acceptance per position the goodput planner assumes before it has read any (S̄_j = 0.7^j, SmartSpec's prior)
and drifts back to in rounds of plain decoding, so that drafting is tried again."""


class Signal:
    """What a goodput planner reads of each drafted candidate: a_j, its chance of acceptance given that the round's
    earlier candidates were accepted, computed from what was known before ŷ_j was drawn, so that the survival
    S_j = Π_{i≤j} a_i may rank position j (module docstring). Until `ready` (a signal still fitting itself) the
    planner drafts to its cap and checks every candidate."""

    name: ClassVar[str] = ""

    @property
    def ready(self) -> bool:
        return True

    def acceptance(self, drafted: Drafted) -> float:
        """a_j of a drafted candidate."""
        raise NotImplementedError

    def acceptance_at(self, row: int, drafted: Drafted) -> float:
        """a_j of a candidate `row` drafted (a signal that keeps each request's history reads the row's)."""
        return self.acceptance(drafted)

    def admit(self, row: int) -> None:
        """A new request takes `row`."""

    def observe(self, rounds: Mapping[int, list[Drafted]], outcomes: Mapping[int, list[Outcome]]) -> None:
        """A round's drafted candidates per row, and the outcomes of those the target checked."""


class HeadSignal(Signal):
    """An expected-acceptance head's α̂_j (`decides: before_draw`): read from the state that produced q_j and q_j's
    signals, so a row's survival product is the one the engine hands a budget (`Drafted.acceptance`)."""

    name: ClassVar[str] = "head"

    def acceptance(self, drafted: Drafted) -> float:
        return drafted.score


class TopOneSignal(Signal):
    """D-Cut's signal: the draft's top-1 probability max q_j, a property of q_j, not of the token drawn from it."""

    name: ClassVar[str] = "top1"

    def acceptance(self, drafted: Drafted) -> float:
        return drafted.top1


class VllmSignal(Signal):
    """vLLM's online acceptance estimate on an ex-ante feature: σ(w · logit(max q_j) + b_j), fitted as
    `specheads.decoding.online.VllmEstimator` fits it (one slope, an intercept per position, damped Newton on the last
    100 rounds' outcomes every `refit_every` rounds); ready after `warmup_refits` refits, vLLM's window of full
    verification. A round of the batch is one vLLM step (one scheduler step serves every running request)."""

    name: ClassVar[str] = "vllm"

    def __init__(self, positions: int, refit_every: int = 100, warmup_refits: int = 3):
        self.fit = VllmEstimator(0.0, positions, refit_every=refit_every, warmup_refits=warmup_refits)

    @property
    def ready(self) -> bool:
        return self.fit.refits >= self.fit.warmup_refits

    def acceptance(self, drafted: Drafted) -> float:
        return self.fit.probability(replace(drafted, prob=drafted.top1))

    def observe(self, rounds: Mapping[int, list[Drafted]], outcomes: Mapping[int, list[Outcome]]) -> None:
        self.fit.window.append([(drawn_logit(rounds[row][o.position - 1].top1), min(o.position, self.fit.positions),
                                 o.accepted) for row, checked in outcomes.items() for o in checked])
        self.fit.steps += 1
        if self.fit.steps % self.fit.refit_every == 0:
            self.fit.refit()


class DSparkSignal(Signal):
    """A DSpark drafter's confidence head, σ(proj([slot state ; Markov embedding of the token before])): candidate j's
    acceptance predicted from what precedes its draw (`Drafted.drafter_score`), computed in the block's forward, so it
    ranks exactly and costs nothing extra; trained jointly with the drafter (DSpark's own head), uncalibrated here."""

    name: ClassVar[str] = "dspark_confidence"

    def acceptance(self, drafted: Drafted) -> float:
        return 1.0 if drafted.drafter_score is None else drafted.drafter_score


class DSparkScaledSignal(Signal):
    """`DSparkSignal` through the drafter's per-position temperatures (`Drafted.drafter_score_scaled`), as SGLang plans
    with its temperature table: exact for the same reason."""

    name: ClassVar[str] = "dspark_confidence_ts"

    def acceptance(self, drafted: Drafted) -> float:
        return 1.0 if drafted.drafter_score_scaled is None else drafted.drafter_score_scaled


SignalFactory = Callable[[int], Signal]
"""A signal for rounds of at most that many candidates."""
SIGNALS: dict[str, SignalFactory] = {"head": lambda positions: HeadSignal(), "top1": lambda positions: TopOneSignal(),
                                     "vllm": VllmSignal, "dspark_confidence": lambda positions: DSparkSignal(),
                                     "dspark_confidence_ts": lambda positions: DSparkScaledSignal()}
"""Every signal a goodput planner or a stop rule may read, by name; `specheads.decoding.calibration` adds the estimates
refitted while serving (`register_signal`)."""


def register_signal(name: str, factory: SignalFactory) -> None:
    """Add the signal `name` to `SIGNALS`."""
    SIGNALS[name] = factory


def make_signal(name: str, positions: int) -> Signal:
    """The signal `name` (`SIGNALS`) for rounds of at most `positions` candidates."""
    return SIGNALS[name](positions)


class SignalReader(PassivePlanner):
    """A planner that reads a signal along every row's round and lets it
    learn from the round's outcomes: each row's survival product S_k = Π a_j so far, and the round's drafted
    candidates, kept from `verify_lengths` (which checks them all unless a subclass trims) to `observe`. Its state is
    each subclass's fields; `admit` and `observe` pass on to the next planner among the subclass's bases too."""

    signal: Signal
    survival: dict[int, float]
    rounds: dict[int, list[Drafted]]

    def admit(self, row: int) -> None:
        super().admit(row)
        self.signal.admit(row)

    def read(self, row: int, drafted: Drafted) -> tuple[float, float]:
        """(a_k, S_k) of the candidate `row` just drafted, S_k kept for the row's next candidate."""
        acceptance = clean(self.signal.acceptance_at(row, drafted))
        survival = (1.0 if drafted.index == 1 else self.survival.get(row, 1.0)) * acceptance
        self.survival[row] = survival
        return acceptance, survival

    def keep(self, rounds: Mapping[int, list[Drafted]]) -> None:
        """Keep the round's drafted candidates for the signal to learn from."""
        self.rounds = {row: list(seen) for row, seen in rounds.items()}

    def verify_lengths(self, rounds: Mapping[int, list[Drafted]]) -> dict[int, int] | None:
        self.keep(rounds)
        return None

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        super().observe(outcomes)
        self.signal.observe(self.rounds, outcomes)
        self.rounds = {}


def last(survival: list[float]) -> float:
    """The acceptance of a row's last drafted candidate, S_k / S_{k-1}, from its survival products."""
    if len(survival) == 1:
        return survival[0]
    return survival[-1] / survival[-2] if survival[-2] > 0.0 else 0.0


def survival_products(acceptances: list[float]) -> list[float]:
    """S_j = Π_{i≤j} a_i, each a_i `clean`ed into [0, 1], so S never rises along a row."""
    products, survival = [], 1.0
    for acceptance in acceptances:
        survival *= clean(acceptance)
        products.append(survival)
    return products


def planned_goodput(survival: list[float], rows: int, k: int, costs: ServingCosts, verified: int | None = None,
                    head_cost: float | None = None) -> float:
    """The modelled goodput of a round in which each of `rows` rows drafts k candidates and the target checks
    `verified` of them (all, rows · k, by default), the likeliest first, S̄_j being position j's expected survival:
    rows + Σ of the checked positions' S̄ tokens in k · (t_draft(rows) + t_head(rows)) + t_target(rows + verified) +
    the deferred catch-up seconds, every forward on the round's rows; t_head is the forward of the head that scores
    each candidate, as `round_seconds` prices it (`ServingCosts.scoring` at h = `head_cost`; none for a free
    signal). k = 0 is plain decoding: rows tokens in t_target(rows), the draft's catch-up (one more token a row in
    its next forward, `ServingCosts.catch_up`) deferred; at k ≥ 1 a row defers it when all its k candidates are
    checked and accepted (S̄_k), the last of them unread by the draft. A block drafter's k draft forwards are one
    (`ServingCosts.drafting`), and its deferred catch-up is every emitted token (`deferred_share`)."""
    verified = rows * k if verified is None else verified
    full, part = divmod(verified, rows)  # every row's first `full` positions, then `part` rows' next one
    expected = rows * sum(survival[:full]) + (part * survival[full] if part else 0.0)
    return float((rows + expected) / (costs.drafting(rows, k, head_cost) + costs.target.price(rows + verified, rows)
                                      + deferred_share(survival, rows, k, verified, costs.block, expected)
                                      * costs.catch_up(rows)))


def deferred_share(survival: list[float], rows: int, k: int, verified: int | np.ndarray, block: int | None = None,
                   expected: float | np.ndarray = 0.0) -> float | np.ndarray:
    """The expected share of the `rows` rows whose last token the draft has not read after a round of k candidates a
    row, `verified` of them checked (the likeliest first; an array of counts gives the share of each): every row at
    k = 0 (the draft did not run); at k ≥ 1 the rows whose k candidates were all checked, each with chance S̄_k that
    all stand (the last of them unread). The one catch-up term of `planned_goodput`, `plan_round` and SmartSpec.
    For a block drafter (`block` given) every token the round emits is a context token of a later block: 1 + the
    round's `expected` accepted candidates (beside `verified`'s) over the rows."""
    if block is not None:
        return 1.0 + expected / rows
    if k == 0:
        return 1.0
    return np.clip(verified - rows * (k - 1), 0, rows) / rows * survival[k - 1]


def plan_round(survival: list[float], rows: int, largest: int, costs: ServingCosts,
               head_cost: float | None = None) -> tuple[int, float]:
    """The K in 0..`largest` whose round has the largest `planned_goodput` (the head's forwards at `head_cost`) when
    the target checks the best number of its candidates (all of them among the choices; ties: the smaller K, then the
    fewer checked), and that goodput.
    Its K = 0, K = largest and every constant K in between are among the rounds it compares."""
    gains = np.concatenate([[0.0], np.cumsum(np.repeat(np.asarray(survival[:largest], float), rows))])
    target = np.asarray([costs.target.price(rows + verified, rows) for verified in range(rows * largest + 1)])
    catch_up = costs.catch_up(rows)
    best, rate = 0, rows / (float(target[0]) + catch_up)
    for k in range(1, largest + 1):
        deferred = deferred_share(survival, rows, k, np.arange(rows * k + 1), costs.block, gains[: rows * k + 1])
        seconds = costs.drafting(rows, k, head_cost) + target[: rows * k + 1] + deferred * catch_up
        goodput = (rows + gains[: rows * k + 1]) / seconds
        if goodput.max() > rate:
            best, rate = k, float(goodput.max())
    return best, rate


def threshold_verify_lengths(survival: Mapping[int, list[float]], rate: float, target: CostCurve) -> dict[int, int]:
    """Each row's verify length at the goodput `rate` ρ: take positions in order of S (ties: lower row, earlier
    position) while the next one's expected token pays for what it adds to the target's forward at that rate,
    S ≥ ρ · (t(n + 1) − t(n)) with n the tokens already in it (one per row to start) and t priced on the round's rows;
    stop at the first that does not. S never rising along a row, each row's checked candidates are a prefix."""
    lengths = {row: 0 for row in survival}
    rows = tokens = len(survival)
    for negative, row, index in ranked_positions(survival):
        if index != lengths[row] + 1:  # never for a non-increasing S (the sort puts a row's positions in order)
            continue
        if -negative < rate * (target.price(tokens + 1, rows) - target.price(tokens, rows)):
            break
        tokens, lengths[row] = tokens + 1, index
    return lengths


@dataclass
class GoodputPlanner(SignalReader, PlansOnCosts):
    """A verify budget that counts the draft's time and may choose not to speculate (docs/decoding-core.md "Verify
    budgets"); `signal` is where each candidate's acceptance comes from, the only thing that differs between the
    goodput, D-Cut and vLLM rules. Per round of B rows:

    1. `round_cap`, from the past only: S̄_j, the signal's recent mean survival at position j over the rows (a row
       that stopped drafting before j goes on at its last candidate's acceptance), and the K in 0..`max_k` whose
       round has the largest `planned_goodput` (`plan_round`: the draft's forwards counted, the head's that scores
       each candidate and the draft's deferred catch-up too; K = 0 is plain decoding). That goodput ρ is the rate
       every later choice of the round is priced at.
    2. `stops`: a row that has drafted k candidates, with survival S_k and last acceptance a_k, drafts one more while
       that candidate's expected token, S_k · a_k, pays at ρ for what the row adds to a draft forward of B rows (and
       to the head's forward of that step, t_head, where a head scores) and one more token in the target's forward,
       less the catch-up it spares (u = catch-up(B) / B a row, deferred with chance S_k when the row stops,
       S_k · a_k when it drafts on):
       S_k · a_k > ρ · (t_draft(B) − t_draft(B − 1) + t_head(B) − t_head(B − 1) − u · S_k (1 − a_k)
                        + t_target(B(k + 1) + 1) − t_target(B(k + 1))),
       every forward priced on the round's B rows (`CostCurve.price`).
       It reads the row's own candidates and the past only, never another row's: that keeps every row's drafting,
       and so the positions the verify step ranks, independent of the other rows' draws.
    3. `verify_lengths`: `threshold_verify_lengths` at ρ, on the survival products of the drafted candidates.

    A signal not yet `ready` drafts every row to the cap and checks every candidate (vLLM's warm-up). For a block
    drafter (`PlansOnCosts.price_draft`) the round's draft forwards are one block forward, a row's next candidate
    costs no draft forward (t_draft(B) − t_draft(B − 1) drops out), and every emitted token is read as context by a
    later block (+u · S_k · a_k in place of the catch-up spared: `ServingCosts.deferred_step`).
    """

    costs: ServingCosts
    signal: Signal
    max_k: int | None = None  # the largest K it may plan; the cap otherwise
    smoothing: float = 0.1  # the weight of a round in the expected survival
    expected: list[float] = field(default_factory=list)  # S̄_1, S̄_2, …
    rate: float = 0.0  # ρ, this round's planned goodput
    k: int = 0  # this round's K
    rows: int = 0  # this round's rows
    survival: dict[int, float] = field(default_factory=dict)  # each drafting row's S so far
    rounds: dict[int, list[Drafted]] = field(default_factory=dict)  # this round's drafted candidates per row
    warmup_rounds: int = 0  # rounds planned while the signal was still fitting (drafted to the cap, all checked)
    head_cost: float | None = None  # h of the head that scores each candidate (`price_head`); None: a free signal

    def price_head(self, head_cost: float) -> None:
        self.head_cost = head_cost

    def round_cap(self, rows: int, cap: int) -> int:
        largest = cap if self.max_k is None else min(cap, self.max_k)
        self.expected += [SIGNAL_PRIOR ** (j + 1) for j in range(len(self.expected), largest)]
        self.rows = rows
        if self.signal.ready:
            self.k, self.rate = plan_round(self.expected, rows, largest, self.costs, self.head_cost)
        else:  # a signal still fitting: draft to the cap and check everything
            self.k, self.rate = largest, planned_goodput(self.expected, rows, largest, self.costs, head_cost=self.head_cost)
            self.warmup_rounds += 1
        return self.k

    def stops(self, row: int, drafted: Drafted) -> bool:
        if not self.signal.ready:
            return False
        acceptance, survival = self.read(row, drafted)
        return not self.worth_drafting(survival, drafted.index, acceptance)

    def worth_drafting(self, survival: float, drafted: int, acceptance: float) -> bool:
        """Whether a row whose `drafted` candidates survive with `survival`, the last accepted with `acceptance`,
        should draft one more (class docstring)."""
        if drafted >= self.k:
            return False
        rows, target = self.rows, self.costs.target
        tokens = rows * (drafted + 1)
        step = self.costs.draft_step(rows, self.head_cost) + self.costs.deferred_step(rows, survival, acceptance)
        return worth_drafting(survival, acceptance, self.rate, step,
                              target.price(tokens + 1, rows) - target.price(tokens, rows))

    def verify_lengths(self, rounds: Mapping[int, list[Drafted]]) -> dict[int, int]:
        self.keep(rounds)
        if not self.signal.ready:
            return {row: len(seen) for row, seen in rounds.items()}
        return threshold_verify_lengths(self.round_survival(), self.rate, self.costs.target)

    def round_survival(self) -> dict[int, list[float]]:
        """The survival products of this round's drafted candidates, per row."""
        return {row: survival_products([self.signal.acceptance_at(row, d) for d in seen])
                for row, seen in self.rounds.items()}

    def observe(self, outcomes: Mapping[int, list[Outcome]]) -> None:
        drafted = [survival for survival in self.round_survival().values() if survival]
        kept = 1.0 - self.smoothing
        for j, mean in enumerate(self.expected):
            if drafted:  # a row that stopped before j goes on at its last candidate's acceptance
                reading = sum(s[j] if j < len(s) else s[-1] * last(s) ** (j + 1 - len(s)) for s in drafted) / len(drafted)
            else:  # a round of plain decoding: back towards the prior, so that drafting is tried again
                reading = SIGNAL_PRIOR ** (j + 1)
            self.expected[j] = kept * mean + self.smoothing * reading
        super().observe(outcomes)


def require_costs(name: str, costs: ServingCosts | None) -> ServingCosts:
    if costs is None:
        raise UsageError(f"the {name} rule plans from the models' cost curves; pass costs (specheads.decoding.costs)")
    return costs


def require_before_draw(name: str, head: Any) -> None:
    """Refuse a head that read the drafted token for rule `name`, which ranks drafted positions across rows by the
    head's survival products: ranking by what was drawn and dropping the rest changes the output's distribution."""
    if head.decides != "before_draw":
        raise UsageError(f"the {name} rule ranks drafted positions across rows by the head's survival product; a "
                         f"{head.head_type} head decides {head.decides} (it has read the drafted token), which makes "
                         "the output differ from the target's; use an expected_acceptance head")


@register
@dataclass(frozen=True)
class VerifyBudget(StopPolicy):
    """The batch-level verify budget (SV §5, DSpark's planner): every row drafts up to the cap, stopping early once
    the survival product S_k = Π α̂_j of an expected-acceptance head falls below `threshold` (the floor) or below
    what the previous round's greedy refused; then the verify lengths of all rows are chosen together by the goodput
    greedy. Exact: it needs a head that decides before the draw (module docstring)."""

    name: ClassVar[str] = "budget"
    reads_head: ClassVar[bool] = True

    def planner(self, costs: ServingCosts | None) -> Any:
        return BudgetPlanner(require_costs(self.name, costs), self.threshold)

    def check_head(self, head: Any) -> None:
        super().check_head(head)
        require_before_draw(self.name, head)


@register
@dataclass(frozen=True)
class SmartSpecK(StopPolicy):
    """SmartSpec's goodput K: one K per round for the whole batch, from the acceptance rate of past rounds and the
    cost curves (`SmartSpecPlanner`); `threshold` is the largest K it may pick."""

    name: ClassVar[str] = "smartspec"

    def planner(self, costs: ServingCosts | None) -> Any:
        return SmartSpecPlanner(require_costs(self.name, costs), max_k=int(self.threshold))


@register
@dataclass(frozen=True)
class GoodputPlan(StopPolicy):
    """The goodput planner (`GoodputPlanner`) reading an expected-acceptance head: per
    round, the batch's K from the modelled goodput with the draft's time counted (K = 0 is plain decoding), each
    row's drafting ended once one more candidate is not worth its draft and target time, and the verify lengths
    chosen in order of the survival products. `threshold` is the largest K it may plan (it needs no tuned value).
    Exact with a head that decides before the draw (docs/decoding-core.md "Verify budgets")."""

    name: ClassVar[str] = "goodput"
    reads_head: ClassVar[bool] = True
    signal: ClassVar[str] = "head"  # what ranks the positions (`SIGNALS`)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_whole(self.threshold, f"the {self.name} rule's value, the largest K it may plan,")

    def planner(self, costs: ServingCosts | None) -> Any:
        return GoodputPlanner(require_costs(self.name, costs), make_signal(self.signal, int(self.threshold)),
                              max_k=int(self.threshold))

    def check_head(self, head: Any) -> None:
        super().check_head(head)
        if self.reads_head:
            require_before_draw(self.name, head)


@register
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


@register
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


@register
@dataclass(frozen=True)
class DSparkAdaptive(GoodputPlan):
    """vLLM's adaptive verification of a DSpark drafter in the goodput planner: each candidate's acceptance is the
    drafter's own confidence head (`DSparkSignal`), as vLLM and SGLang plan a DSpark draft's verify budget with it.
    Exact: the confidence is known before the draw; it needs a DSpark drafter with its confidence head."""

    name: ClassVar[str] = "dspark_adaptive"
    reads_head: ClassVar[bool] = False
    reads_drafter_score: ClassVar[bool] = True
    signal: ClassVar[str] = "dspark_confidence"


@register
@dataclass(frozen=True)
class DSparkAdaptiveScaled(DSparkAdaptive):
    """`dspark_adaptive` on the confidence through the drafter's per-position temperatures (`DSparkScaledSignal`)."""

    name: ClassVar[str] = "dspark_adaptive_ts"
    reads_drafter_temperatures: ClassVar[bool] = True
    signal: ClassVar[str] = "dspark_confidence_ts"
