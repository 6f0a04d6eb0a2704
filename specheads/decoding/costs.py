"""Forward cost against the tokens in a forward, and the modelled time of rounds served together.

A `CostCurve` is one model's forward time against the tokens in the forward (measured on the decoding device by
`measure_cost_curve`, or given), never falling as the tokens grow. `CostCurve.price(tokens, rows)` prices a forward
of `tokens` new tokens over `rows` rows of the batch: a measured or given curve was timed as n rows of one token each,
so it prices by the tokens alone; a roofline preset's curve (`specheads.decoding.cost_table.RooflineCurve`) prices the
rows exactly (each row reads its own cache once, however many tokens it holds). The round engine records each round
of a batch as a `RoundRecord` (per row: the candidates it drafted, the tokens each of its draft forwards read, and the
candidates it sent to the target); a round costs

    Σ_{s=1..max k} c_draft(tokens read at step s; rows drafting at step s) + c_target(Σ_rows (verified + 1); rows)
      + Σ_s c_head(tokens scored at step s)

seconds (`round_seconds`), the prompt's prefill left out (the same for every policy). A row's first draft forward of
a round reads every token its draft has not read: the target's token, the last candidate too after a round that
accepted them all, and one more for each round of plain decoding (K = 0) since the draft last ran (its catch-up). The
last term is the acceptance head's forwards, where a rule reads one: at each draft step one head forward over the
tokens the rows' heads scored there, on the head's own curve (`ServingCosts.head`: measured by `measure_head_curve`)
or, without one, at the head's share of the draft's weights (`RoundRecord.head_cost`, `head_forward_cost`) times the
draft's curve. A rule reading free signals (the draft's confidence or entropy) has no such term. A draft that computes something more for
each candidate after its forward (a DSpark drafter's Markov bias and confidence head) adds, at each draft step, that
work over the candidates the rows drew there, at its share of the draft's weights (`RoundRecord.candidate_cost`,
`specheads.decoding.features.FeatureDraft.candidate_cost`) times the draft's curve (`candidate_seconds`). The planners
read the same prices to choose how much to draft and verify (`specheads.decoding.planners`).

A block drafter (DSpark) drafts a round's candidates from one forward over its block of slots, reading as context the
tokens emitted since it last ran: its rounds record that one forward (`BatchCache.round_widths`), the planners plan on
it (`ServingCosts.block`, told by the engine: `PassivePlanner.price_draft`), and the oracle is counted one forward a
round that keeps a candidate (`hindsight_forwards`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from specheads.decoding.cache import BatchCache
from specheads.plumbing.errors import UsageError

COUNTED = "tokens emitted / (c · (draft forwards + head forwards) + target calls)"
"""How a modelled speedup is counted (a report's decoding section's `speedup_from`, and the model card's words); reports
without it used SpecDec++ Eq. 5.1, which overstates SPRINTER; reports whose `speedup_from` has no head forwards counted
the head free."""
CURVE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
FALLING_FIX = "re-run `specheads profile` on a quiet machine (it keeps the running maximum of what it measures)"


def first_fall(seconds: Sequence[Any]) -> int | None:
    """The index of the first time below the one before it (None when the times never fall)."""
    return next((i for i in range(1, len(seconds)) if seconds[i] < seconds[i - 1]), None)


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward against the tokens in it, linear between the points and beyond the last two (never
    falling: a curve whose times fall is refused, and beyond its last point it stays flat rather than fall).
    `raised`: the token counts whose measured time `measure_cost_curve` raised to an earlier count's."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    raised: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds) or list(self.tokens) != sorted(set(self.tokens)):
            raise UsageError(f"a cost curve needs two or more increasing token counts with one time each, got tokens "
                             f"{list(self.tokens)} and seconds {list(self.seconds)}")
        if min(self.tokens) < 1 or not all(math.isfinite(s) and s > 0 for s in self.seconds):
            raise UsageError(f"a cost curve's token counts must be >= 1 and its times finite and > 0, got "
                             f"{list(self.tokens)}, {list(self.seconds)}")
        fall = first_fall(self.seconds)
        if fall is not None:
            raise UsageError(f"a cost curve's time falls from {self.seconds[fall - 1]:g} s at {self.tokens[fall - 1]} "
                             f"tokens to {self.seconds[fall]:g} s at {self.tokens[fall]}: a forward over more tokens "
                             f"takes no less time; {FALLING_FIX}")

    def __call__(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        x, y = np.asarray(self.tokens, float), np.asarray(self.seconds, float)
        if tokens <= x[-1]:
            return float(np.interp(tokens, x, y))
        slope = max((y[-1] - y[-2]) / (x[-1] - x[-2]), 0.0)
        return float(y[-1] + slope * (tokens - x[-1]))

    def price(self, tokens: int, rows: int) -> float:
        """Seconds of one forward of `tokens` new tokens over `rows` rows of the batch. This curve was timed as n rows
        of one token each (or is given so), so it prices by the tokens alone: rows reading several tokens each are
        priced as that many rows of one (on an accelerator, an over-count of their cache reads)."""
        return self(tokens)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CostCurve:
        """From `{tokens: [...], seconds: [...]}` (and `raised: [...]` where the measurement was raised)."""
        try:
            return cls(tuple(int(t) for t in values["tokens"]), tuple(float(s) for s in values["seconds"]),
                       tuple(int(t) for t in values.get("raised", ())))
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"a cost curve is {{tokens: [...], seconds: [...]}}, got {values!r}") from None

    def as_dict(self) -> dict[str, list]:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds),
                **({"raised": list(self.raised)} if self.raised else {})}


def monotone_curve(tokens: tuple[int, ...], seconds: list[float]) -> CostCurve:
    """The curve of measured `seconds` made non-decreasing: each time raised to the largest before it (a measurement
    that fell, which a busy machine gives), the raised token counts kept in `raised`."""
    running = np.maximum.accumulate(np.asarray(seconds, float))
    raised = tuple(n for n, measured, kept in zip(tokens, seconds, running) if measured < kept)
    return CostCurve(tuple(tokens), tuple(float(s) for s in running), raised)


@torch.no_grad()
def measure_cost_curve(model: Any, context: int = 32, tokens: tuple[int, ...] = CURVE_TOKENS, repeats: int = 3) -> CostCurve:
    """The forward time of `model` on its device against the tokens in the forward: n rows of one new token each,
    every row with `context` cached tokens (the median of `repeats` timings per n), made non-decreasing
    (`monotone_curve`: a time below an earlier one is raised to it and listed in `raised`). The context is computed once and
    loaded into every row (`BatchCache.load`) where the cache layout allows, so the curve costs no prefill per n."""
    vocab = model.get_input_embeddings().weight.shape[0]
    prefix = [(7 * i + 3) % vocab for i in range(context)]
    single = BatchCache(model, 1)
    single.feed({0: prefix})
    stored = single.snapshot(0, context) if single.plain_layers() else None
    seconds = []
    for n in tokens:
        cache = BatchCache(model, n)
        if stored is not None:
            cache.load(dict.fromkeys(range(n), stored))
        else:
            cache.feed(dict.fromkeys(range(n), prefix))
        timings = []
        for _ in range(repeats):
            synchronize(cache.device)
            start = time.perf_counter()
            cache.feed({row: [row % vocab] for row in range(n)})
            synchronize(cache.device)
            timings.append(time.perf_counter() - start)
            for row in range(n):
                cache.crop_row(row, context)
            cache.trim()
        seconds.append(float(np.median(timings)))
    return monotone_curve(tuple(tokens), seconds)


@torch.no_grad()
def measure_head_curve(head: Any, tokens: tuple[int, ...] = CURVE_TOKENS, repeats: int = 3) -> CostCurve:
    """The forward time of an acceptance head on its device against the tokens it scores in one call (n rows of a draft
    state, and of the candidate's embedding and signals where the head reads them, as the round engine scores a draft
    step's rows): the median of `repeats` timings per n after one untimed call, made non-decreasing in n (a curve
    this small is timed near the clock's resolution, where a larger n can time faster)."""
    device = next(head.parameters()).device
    seconds = []
    for n in tokens:
        inputs = (torch.randn(n, head.hidden_size, device=device),
                  torch.randn(n, len(head.extra_features), device=device) if head.extra_features else None,
                  torch.randn(n, head.candidate_embedding_size, device=device) if head.candidate_embedding_size else None,
                  torch.ones(n, dtype=torch.long, device=device))
        head.predict(*inputs)
        timings = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            head.predict(*inputs)
            synchronize(device)
            timings.append(time.perf_counter() - start)
        seconds.append(float(np.median(timings)))
    return monotone_curve(tuple(tokens), seconds)


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class ServingCosts:
    """The draft's and the target's cost curves, and the acceptance head's where it was measured (None: a head's
    forward is priced at its share of the draft's weights, `RoundRecord.head_cost`, times the draft's curve).

    `block` is the draft's forward shape (`shaped`): None, one forward a candidate (a causal LM, an EAGLE-3 drafter:
    a round of k candidates runs k forwards of one token a row); n, one forward over a block of n slots a round (a
    DSpark drafter: a round that drafts at all runs one forward, however many of its candidates it uses, and that
    forward also reads as context every token emitted since the drafter last ran, one token a row each)."""

    draft: CostCurve
    target: CostCurve
    head: CostCurve | None = None
    block: int | None = None
    candidate: float = 0.0  # what the draft computes for each candidate after its forward (a DSpark drafter's Markov
    # bias), in draft forwards (`candidate_cost`)

    def shaped(self, block: int | None, candidate: float = 0.0) -> ServingCosts:
        """The same curves for a draft of forward shape `block` that computes `candidate` draft forwards' worth for
        each candidate it draws (class docstring)."""
        return replace(self, block=block, candidate=candidate)

    def scaled_draft(self, ratio: float) -> ServingCosts:
        """The same target with a draft `ratio` times as costly as the target at every token count (a 7B/70B view); a
        head measured beside the real draft does not carry over: the head is priced at its share of the draft's
        weights."""
        return ServingCosts(CostCurve(self.target.tokens, tuple(ratio * s for s in self.target.seconds)), self.target,
                            block=self.block, candidate=self.candidate)

    def catch_up(self, rows: int) -> float:
        """What one more token in each of `rows` rows adds to the draft's next forward: the cost a round defers when
        its draft did not read its rows' last token (a round of plain decoding, K = 0; or one whose candidates were
        all accepted, the last of them never read by the draft); for a block drafter, what one more context token a
        row adds to its block's forward (every emitted token is one: `deferred_step`)."""
        if rows <= 0:
            return 0.0
        if self.block is not None:
            return self.draft.price(rows * (self.block + 1), rows) - self.draft.price(rows * self.block, rows)
        return self.draft.price(2 * rows, rows) - self.draft.price(rows, rows)

    def drafting(self, rows: int, k: int, head_cost: float | None = None) -> float:
        """Seconds of a round's drafting when each of `rows` rows drafts k candidates, a head scoring each where
        `head_cost` is given (`scoring`): k draft forwards of one token a row, or, for a block drafter, one forward
        over the rows' blocks (none at k = 0); the catch-up is priced apart (`catch_up`)."""
        if k <= 0:
            return 0.0
        scoring = k * (self.scoring(rows, head_cost) + self.candidates(rows))
        if self.block is not None:
            return self.draft.price(rows * self.block, rows) + scoring
        return k * self.draft.price(rows, rows) + scoring

    def draft_step(self, rows: int, head_cost: float | None = None) -> float:
        """What one row's next candidate adds to a round of `rows` rows that already drafts (its draft forward over
        one more token, and the head's where one scores it); a block drafter drew it from the block it holds, so only
        the head's forward is left."""
        scoring = (self.scoring(rows, head_cost) - self.scoring(rows - 1, head_cost)
                   + self.candidates(rows) - self.candidates(rows - 1))
        if self.block is not None:
            return scoring
        return self.draft.price(rows, rows) - self.draft.price(rows - 1, rows - 1) + scoring

    def deferred_step(self, rows: int, survival: float, acceptance: float) -> float:
        """The change in deferred catch-up seconds when a row of `rows` whose candidates so far stand with chance
        `survival` drafts one more, accepted with chance `acceptance`: a chain's draft reads the candidate now, so its
        catch-up is deferred only when that one stands too (it spares u·S·(1 − a), u the catch-up a row); a block
        drafter reads every emitted token as context later, so the candidate adds u·S·a."""
        unit = self.catch_up(rows) / rows
        if self.block is not None:
            return unit * survival * acceptance
        return -unit * survival * (1.0 - acceptance)

    def scoring(self, tokens: int, head_cost: float | None) -> float:
        """Seconds of one head forward over `tokens` scored tokens (a draft step's rows), as `head_seconds` prices it:
        on the head's curve where measured, else `head_cost` (h, `head_forward_cost`) times the draft's forward over
        them; nothing where no head scores (`head_cost` None: a free signal) or no token is scored."""
        if head_cost is None or tokens <= 0:
            return 0.0
        return self.head(tokens) if self.head is not None else head_cost * self.draft.price(tokens, tokens)

    def candidates(self, tokens: int) -> float:
        """Seconds of what the draft computes after its forward for `tokens` candidates drawn at one draft step (a
        DSpark drafter's Markov bias): `candidate` times the draft's forward over them (`candidate_seconds`)."""
        return candidate_seconds(tokens, self.candidate, self.draft)


@dataclass
class RoundRecord:
    """One round of a batch: per row (by request), the candidates drafted and the candidates the target checked
    (the hindsight oracle: both are the candidates it kept), and the tokens the round added to its output."""

    requests: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    draft_widths: list[list[int]] = field(default_factory=list)  # per row, the tokens of each of its draft forwards
    # (the first: the tokens its draft had not read, its catch-up; then one a step for a chain, the nodes read
    # together for a tree); when empty (rounds recorded before widths were), one token in each of `drafted` steps
    head_widths: list[list[int]] = field(default_factory=list)  # per row, the tokens its acceptance head scored at each
    # of its draft forwards; empty when no head scored
    head_cost: float = 0.0  # a head forward over one token in draft forwards (`head_forward_cost`): its price without a
    # measured head curve
    candidate_cost: float = 0.0  # what the draft computes for each candidate after its forward, in draft forwards (a
    # DSpark drafter's Markov bias: `FeatureDraft.candidate_cost`)


def chain_widths(drafted: list[int]) -> list[list[int]]:
    """The draft forwards of chain rounds of `drafted` candidates each: one token a forward."""
    return [[1] * k for k in drafted]


def hindsight_forwards(accepted_per_round: list[int], block: int | None, candidate_cost: float = 0.0) -> float:
    """The draft forwards the hindsight oracle is counted, drafting only the candidates the target accepts: one a
    candidate, or, for a draft of forward shape `block` (`ServingCosts.block`), one a round that keeps any; and
    `candidate_cost` a candidate for what the draft computes for each after its forward (a DSpark drafter's Markov
    bias)."""
    extra = candidate_cost * sum(accepted_per_round)
    if block is not None:
        return sum(1 for accepted in accepted_per_round if accepted) + extra
    return sum(accepted_per_round) + extra


def hindsight_widths(widths_per_round: list[list[int]], accepted_per_round: list[int],
                     block: int | None) -> list[list[int]]:
    """The tokens of the oracle's draft forwards in each round (`hindsight_forwards`), from those of a run that
    drafted more: its first forward (its catch-up, or a block drafter's block) where it keeps a candidate, then one
    token a further kept candidate for a chain."""
    return [([first[0]] + ([] if block is not None else [1] * (accepted - 1))) if accepted else []
            for first, accepted in zip(widths_per_round, accepted_per_round)]


def round_seconds(record: RoundRecord, costs: ServingCosts) -> float:
    """The modelled seconds of one round (module docstring): the draft's s-th forward reads every drafting row's s-th
    step (its catch-up first, then one token a row for a chain, the nodes a tree reads together), then one target
    forward over the round's rows checks every row's candidates and its own token; each forward priced on its tokens
    and its rows (`CostCurve.price`); the head's forwards, where a head scored (`head_seconds`); and what the draft
    computes for each candidate after its forward, at each step over the rows that drew one (`candidate_seconds`)."""
    if not record.drafted:
        return 0.0
    widths = record.draft_widths or chain_widths(record.drafted)
    steps = max((len(row) for row in widths), default=0)
    draft = sum(costs.draft.price(sum(row[s] for row in widths if len(row) > s), sum(len(row) > s for row in widths))
                for s in range(steps))
    target = costs.target.price(sum(v + 1 for v in record.verified), len(record.verified))
    steps = max(record.drafted, default=0)
    candidates = sum(candidate_seconds(sum(k > s for k in record.drafted), record.candidate_cost, costs.draft)
                     for s in range(steps))
    return draft + target + head_seconds(record, costs) + candidates


def candidate_seconds(tokens: int, candidate_cost: float, draft: CostCurve) -> float:
    """Seconds of what a draft computes for `tokens` candidates drawn at one draft step after its forward (a DSpark
    drafter's Markov bias, at `candidate_cost` draft forwards a candidate): `candidate_cost` times the draft's forward
    over that many tokens (the weight convention a head's forward is priced by, `ServingCosts.scoring`)."""
    if candidate_cost <= 0 or tokens <= 0:
        return 0.0
    return candidate_cost * draft.price(tokens, tokens)


def head_seconds(record: RoundRecord, costs: ServingCosts) -> float:
    """The modelled seconds of a round's head forwards (module docstring): at each draft step, one head forward over
    the tokens the rows' heads scored there (a head reads no cache: priced by its tokens, as rows of one token)."""
    steps = max((len(row) for row in record.head_widths), default=0)
    tokens = [sum(row[s] for row in record.head_widths if len(row) > s) for s in range(steps)]
    return sum(costs.scoring(n, record.head_cost) for n in tokens)


def served_throughput(log: list[RoundRecord], costs: ServingCosts) -> dict[str, float]:
    """Modelled seconds, tokens and tokens/s of a served queue; and each request's share of them (a round's seconds
    split equally among its rows: in lockstep every row waits for the whole round), for paired intervals."""
    seconds = tokens = 0.0
    per_request: dict[int, list[float]] = {}
    for record in log:
        spent = round_seconds(record, costs)
        seconds += spent
        tokens += sum(record.emitted)
        for request, emitted in zip(record.requests, record.emitted):
            share = per_request.setdefault(request, [0.0, 0.0])
            share[0] += emitted
            share[1] += spent / len(record.requests)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds if seconds else float("nan"),
            "batched_rounds": float(len(log)), "per_request": per_request}
