"""The round engine: one loop of speculative decoding over B rows (B = 1 is a case, not a second loop).

A round, for every row still generating:
1. **draft**: the draft proposes candidates one forward at a time, each drawn from q with the row's own generator;
   the rule (`specheads.decoding.rules`) sees each candidate as it is drafted — its signals, the head's score where
   the rule reads a head — and ends the row's drafting (or the cap, `rule.cap`, does); rows that stopped feed a
   masked pad and are not counted;
2. **verify**: one target forward over every row's tokens it has not seen and the candidates the rule sends
   (`rule.verify_from`), then the p/q test of each checked candidate (`specheads.decoding.sampler`);
3. **accept**: the standing candidates and the target's token, ended at the first stop token and at max_new_tokens;
4. **account**: both caches are cropped to what stands; counts of forwards, calls and tokens per row.
`RoundEngine._round` runs them in that order, each a method of its name, after `_plan_round` has capped every row.

With a prompt cache (`specheads.decoding.prompt_cache`) a row whose prompt was read before starts from the stored keys
and values instead of a prefill; the forwards counted per request are the same either way.

A draft whose output layer has another number of rows than the target's (padded vocabularies: Qwen2.5-0.5B predicts
151 936 tokens, Qwen2.5-7B 152 064) decodes exactly, as transformers' assisted generation maps the assistant's logits
onto the target's vocabulary: q is taken over the target's rows (`fit_vocabulary`). Rows the target has beyond the
draft's get q = 0, so they are never drafted, while the target's p over them is real probability mass that the
residual norm(max(0, p − q)) and the bonus draw honour; rows the draft has beyond the target's are dropped before the
sampling transform, so they are never proposed and q is renormalised over the target's tokens. Speculative sampling
is exact for any q computed from the prefix, provided the candidate is drawn from the q it is tested with, so the
output is the target's distribution either way. A token the draft has no input row for (one the target drew from its
extra rows) is read by the draft as a stand-in id (`RoundEngine.draft_reads`): the draft's later proposals are
poorer, the output stays exact.

Every row draws from its own generator in the same order whatever the batch, so under a per-row rule a row's tokens do
not depend on the other rows (identical in float64; float32 padding can flip a draw that sits on a last-bit tie). Under
a rule with a planner (the verify budget, SmartSpec's K, the rules that adapt at run time) the realised tokens do
depend on the batch; each row's distribution stays the target's.

The round primitives here are public for the tree engine (`specheads.decoding.tree`), which imports this module and
is never imported by it: `candidate_signals` and `acceptance_batch` (a candidate's signals and a head's scores),
`RoundEngine.candidate_embedding` (the candidate's input embedding a head reads), `RoundEngine.round_output` (what a
round adds to the output, ended at a stop token or max_new_tokens), `count_round` (a round into a request's counts)
and `count_head` (the tokens a head scored in it, and what their forwards cost).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specheads.decoding.cache import BatchCache
from specheads.decoding.companion import Companion, head_forward_cost
from specheads.decoding.costs import RoundRecord, ServingCosts, hindsight_forwards
from specheads.decoding.features import draft_block, draft_candidate_cost, refuse_for_draft, round_caches
from specheads.decoding.free_draft import plan_free_round, round_proposal
from specheads.decoding.online import Outcome
from specheads.decoding.prompt_cache import PromptCache
from specheads.decoding.result import DecodeResult
from specheads.decoding.rules import Drafted, StopPolicy
from specheads.decoding.sampler import draw, refuse_non_finite, verify
from specheads.heads import AcceptanceHead, with_derived_signals
from specheads.model_outputs.sampling import SamplingTransform
from specheads.model_outputs.signals import (
    output_width,
    signal_log_probs,
    signal_statistics,
    top_two_margin,
)
from specheads.plumbing.errors import UsageError


def candidate_signals(draft_logits: torch.Tensor, logq_all: torch.Tensor, token: int,
                      transform: SamplingTransform) -> dict[str, float]:
    """The draft's signals for a candidate, as data_gen stored them (logq, entropy, top1, and the derived q),
    `prob`, the candidate's probability under the signal transform, for the confidence rule, and `margin`, the top-2
    logit margin (`top_two_margin`)."""
    logq_signal = signal_log_probs(draft_logits, logq_all, transform)
    entropy, top1, top2 = signal_statistics(logq_signal)
    margin = top_two_margin(float(top1), float(top2))
    return with_derived_signals({"logq": float(logq_all[token]), "entropy": float(entropy), "top1": float(top1),
                                 "prob": math.exp(float(logq_signal[token])), "margin": margin})


@torch.no_grad()
def acceptance_batch(head: AcceptanceHead, states: list[torch.Tensor], signals: list[dict[str, float]],
                     embeddings: list[torch.Tensor | None], positions: list[int],
                     markov: list[torch.Tensor] | None = None) -> list[float]:
    """The head's acceptance probabilities for several rows' candidates in one call; `positions` (1-based in the
    round) apply a stop head's per-position calibration; `markov`: each candidate's Markov embedding of the token
    before it, for a head that reads a DSpark drafter's (`markov_rank`)."""
    device = next(head.parameters()).device  # the head's inputs meet its weights (a split draft's state is elsewhere)
    columns = [[row[name] for name in head.extra_features] for row in signals]
    signal_tensor = torch.tensor(columns, dtype=torch.float32, device=device) if head.extra_features else None
    embedding = torch.cat(embeddings).to(device) if embeddings and embeddings[0] is not None else None
    position = torch.tensor(positions, device=device)
    extra = {"markov_embedding": torch.stack(markov).to(device)} if markov else {}
    return head.predict(torch.stack(states).to(device), signal_tensor, embedding, position, **extra).tolist()


def fit_vocabulary(logits: torch.Tensor, rows: int | None) -> torch.Tensor:
    """Draft logits over the target's `rows` tokens (module docstring): the draft's rows beyond them dropped, rows it
    lacks at -inf (q = 0 there: never drafted); `logits` unchanged when the sizes agree or `rows` is unknown."""
    width = logits.shape[-1]
    if rows is None or rows == width:
        return logits
    if width > rows:
        return logits[..., :rows]
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], rows - width), -math.inf)], dim=-1)


def check_decodable_head(head: AcceptanceHead | None, draft: Any = None) -> None:
    """Refuse, before any forward, a head the round engine cannot feed: one that reads the target's state, or (with
    `draft` given) a DSpark drafter's Markov embedding that `draft` does not make (`markov_rank`)."""
    if head is not None and getattr(head, "target_state_size", 0):
        raise UsageError(f"this {head.head_type} head reads the target's state at the last verified position "
                         f"(target_state_size={head.target_state_size}), which decoding does not feed it; score it "
                         "offline (specheads eval --num-decode-prompts 0), or decode with a head trained without target "
                         "states")
    rank = getattr(head, "markov_rank", 0)
    if head is not None and draft is not None and rank and getattr(draft, "markov_rank", 0) != rank:
        raise UsageError(f"this {head.head_type} head reads a DSpark drafter's Markov embedding of rank {rank}, which "
                         f"this draft does not make (rank {getattr(draft, 'markov_rank', 0)}); decode it with the DSpark "
                         "drafter whose data it was trained on")


def count_head(result: DecodeResult, widths: list[int], forwards: float, called: bool) -> None:
    """Add one round's head scores to a request's counts: `widths`, the tokens its head scored at each draft forward,
    together `forwards` draft forwards' worth (each at its head's `head_forward_cost`); kept per round for a round
    that `called` the target, as `count_round` keeps its per-round counts."""
    result.head_scored += sum(widths)
    result.head_forwards += forwards
    if called:
        result.head_widths_per_round.append(list(widths))


def count_round(result: DecodeResult, drafted: int, accepted: int, called: bool, hindsight: bool = False) -> None:
    """Add one round of a request to its counts: `drafted` candidates (a tree's nodes), `accepted` of them standing in
    the output, and a target call when `called`; `hindsight` (the oracle) counts only the accepted ones as drafted."""
    counted = accepted if hindsight else drafted
    result.drafted += counted
    result.accepted += accepted
    if called:
        result.target_calls += 1
        result.accepted_per_round.append(accepted)
        result.drafted_per_round.append(counted)


StopCheck = Callable[[int, list[int]], bool]
"""(request, its generated tokens so far) -> whether its output ends after the last of them."""


@dataclass
class Drawn:
    """A row's candidate of this draft step: the token, its draft signals, the draft's log q and the state that
    produced q (the one an `at_draft` head reads, or the one that has read the previous candidate)."""

    token: int
    signals: dict[str, float]
    logq_all: torch.Tensor
    state: torch.Tensor


def unread_tokens(tokens: list[int], read: int, generated: list[int]) -> int:
    """The tokens of a request's context (`tokens`, the first `read` of them held by its draft) that its draft's next
    forward reads, its catch-up, as that forward is priced: the target's last token, the last candidate too after a
    round that accepted them all, one more for each round since the draft last ran (plain decoding, K = 0). The prompt
    counts as its last token alone (`generated`: the tokens after it): the prefill is not priced."""
    return min(len(tokens) - read, len(generated) + 1)


@dataclass
class RowRound:
    """One row's round in progress."""

    cap: int
    candidates: list[int] = field(default_factory=list)
    logq_rows: list[torch.Tensor] = field(default_factory=list)
    seen: list[Drafted] = field(default_factory=list)
    acceptance: float = 1.0
    previous: dict[str, float] | None = None  # the signals of the previous candidate (a one-step-late head's input)
    drafted: int = 0  # candidates drafted (a planner may send fewer to the target)
    scored: list[int] = field(default_factory=list)  # per draft forward, the candidates the head scored (0 or 1)
    unread: int = 1  # the tokens its draft has not read, which its first draft forward reads (`ServedBatch.unread`)

    def keep(self, length: int) -> None:
        """Send only the first `length` candidates to the target (a planner's verify length); the rest are dropped."""
        del self.candidates[length:], self.logq_rows[length:], self.seen[length:]


class ServedBatch:
    """The requests of one decode and the rows serving them: each row decodes one request at a time, and a row whose
    request finished takes the next prompt of the queue (its cache rows are cleared; continuous batching)."""

    def __init__(self, prompts: list[list[int]], seeds: list[int], max_new_tokens: int, draft: BatchCache,
                 target: BatchCache, companion: BatchCache | None = None, prompt_cache: PromptCache | None = None,
                 companion_cost: float = 1.0, hindsight: bool = False, block: int | None = None,
                 candidate_cost: float = 0.0):
        self.prompts, self.seeds, self.max_new_tokens = prompts, seeds, max_new_tokens
        self.hindsight = hindsight  # the oracle: it counts the draft forwards of the candidates it keeps
        self.block = block  # the draft's forward shape (`ServingCosts.block`)
        self.candidate_cost = candidate_cost  # what the draft computes for each candidate after its forwards
        self.draft, self.target, self.companion, self.companion_cost = draft, target, companion, companion_cost
        self.prompt_cache = prompt_cache
        self.results = [DecodeResult(tokens=[]) for _ in prompts]
        self.queue = deque(range(len(prompts)))
        rows = len(draft.slots)
        self.request: list[int | None] = [None] * rows
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.generated: list[list[int]] = [[] for _ in range(rows)]
        self.generators: list[torch.Generator | None] = [None] * rows
        self.first_forward = [0] * rows
        self.first_companion_forward = [0] * rows
        self.remembered: list[set[str]] = [set() for _ in range(rows)]  # the models whose prompt cache has the row's prompt
        self.loads: dict[str, dict[int, Any]] = {}  # per model, the stored prompts admitted rows take at `load_prompts`
        self.on_admit: Any = None
        self.finished: list[int] = []
        for row in range(rows):
            self.admit(row)
        self.load_prompts()

    @property
    def caches(self) -> list[BatchCache]:
        """Every model's cache: the draft's, the target's and the companion's where one runs."""
        return [self.draft, self.target, *([self.companion] if self.companion is not None else [])]

    @property
    def named_caches(self) -> dict[str, BatchCache]:
        """Every model's cache by the name the prompt cache keeps its entries under."""
        return {"draft": self.draft, "target": self.target, **({"companion": self.companion} if self.companion else {})}

    @property
    def live(self) -> list[int]:
        """The rows serving a request."""
        return [row for row, request in enumerate(self.request) if request is not None]

    def room(self, row: int) -> int:
        """Tokens the row's request may still add."""
        return self.max_new_tokens - len(self.generated[row])

    def unread(self, row: int) -> int:
        """The tokens the row's draft has not read, which its next forward reads (`unread_tokens`)."""
        return unread_tokens(self.tokens[row], self.draft.length(row), self.generated[row])

    def result(self, row: int) -> DecodeResult:
        return self.results[self.request[row]]

    def admit(self, row: int) -> None:
        """Give `row` the next prompt of the queue (requests with nothing to generate finish at once), or retire it."""
        self.request[row] = None
        while self.queue:
            request = self.queue.popleft()
            if self.max_new_tokens <= 0:
                continue
            for cache in self.caches:
                cache.crop_row(row, 0)
            self.request[row], self.tokens[row], self.generated[row] = request, list(self.prompts[request]), []
            self.find_prompt(row)
            self.generators[row] = torch.Generator().manual_seed(self.seeds[request])
            self.first_forward[row] = self.draft.forwards[row]
            if self.companion is not None:
                self.first_companion_forward[row] = self.companion.forwards[row]
            if self.on_admit is not None:
                self.on_admit(row)
            return

    def prefix(self, row: int) -> tuple[int, ...]:
        """The row's prompt but its last token: what the prompt cache holds (the last is fed in the first round)."""
        return tuple(self.prompts[self.request[row]][:-1])

    def find_prompt(self, row: int) -> None:
        """Note the stored keys and values of the row's prompt, per model, for `load_prompts`. The draft and SV's
        companion are fed the same tokens in lockstep, so they load the prompt together or not at all."""
        self.remembered[row] = set()
        if self.prompt_cache is None or not self.prefix(row):
            return
        found = {name: self.prompt_cache.get(name, cache.model, self.prefix(row))
                 for name, cache in self.named_caches.items() if cache.plain_layers()}
        found = {name: stored for name, stored in found.items() if stored is not None}
        if self.companion is not None and ("draft" in found) != ("companion" in found):
            found.pop("draft", None), found.pop("companion", None)
        for name, stored in found.items():
            self.loads.setdefault(name, {})[row] = stored
            self.remembered[row].add(name)

    def load_prompts(self) -> None:
        """Load the prompts `find_prompt` found into the rows just admitted, one cache extension per model."""
        for name, stored in self.loads.items():
            self.named_caches[name].load(stored)
        self.loads = {}

    def remember_prompt(self, row: int) -> None:
        """Store the row's prompt in the prompt cache for each model that has read all of it and has no entry yet."""
        if self.prompt_cache is None:
            return
        prefix = self.prefix(row)
        for name, cache in self.named_caches.items():
            if prefix and name not in self.remembered[row] and cache.length(row) >= len(prefix) and cache.plain_layers():
                self.prompt_cache.put(name, cache.model, prefix, cache.snapshot(row, len(prefix)))
                self.remembered[row].add(name)

    def emit(self, row: int, emitted: list[int], ended: bool) -> None:
        """Add a round's tokens to the row's request; a request that `ended` (at a stop token or a stop check) or
        reached max_new_tokens records its output, and its row is freed at the next `refill`."""
        self.tokens[row] += emitted
        self.generated[row] += emitted
        if ended or len(self.generated[row]) >= self.max_new_tokens:
            result = self.result(row)
            result.emitted, result.tokens = len(self.generated[row]), list(self.generated[row])
            result.draft_forwards = self.draft.forwards[row] - self.first_forward[row]
            if self.companion is not None:  # SV's companion: each forward counts as `companion_cost` draft forwards
                result.companion_forwards = self.companion.forwards[row] - self.first_companion_forward[row]
                result.draft_forwards += result.companion_forwards * self.companion_cost
            if self.hindsight:  # it would have drafted only the candidates the target accepts
                result.draft_forwards = hindsight_forwards(result.accepted_per_round, self.block)
            result.draft_forwards += self.candidate_cost * result.drafted  # a DSpark drafter's Markov bias
            self.finished.append(row)

    def refill(self) -> None:
        """Give the rows whose requests finished this round the next prompts of the queue."""
        for row in self.finished:
            self.admit(row)
        self.load_prompts()
        self.finished = []


@dataclass
class DecodeRun:
    """One decode in progress: its requests and the rows serving them (with their caches), the rule and the head it
    reads (at `head_cost` draft forwards a scored token), what the draft computes after each forward
    (`candidate_cost`), the planner, and where each round's output goes."""

    batch: ServedBatch
    rule: StopPolicy
    head: AcceptanceHead | None
    head_cost: float
    candidate_cost: float
    planner: Any
    stop_check: StopCheck | None
    on_emit: Callable[[int, list[int]], None] | None
    log: list[RoundRecord] | None


@dataclass
class Accepted:
    """What a row's round leaves: the candidates that stand, the tokens it emits, whether its request ended, the
    candidates the target checked, whether the target was called, and the checked candidates' outcomes (for a
    planner)."""

    standing: int
    emitted: list[int]
    ended: bool
    verified: int
    called: bool
    outcomes: list[Outcome]


class RoundEngine:
    """A draft/target pair and the sampling transform, ready to decode prompts under any rule."""

    def __init__(self, target: Any, draft: Any, transform: SamplingTransform, stop_ids: list[int],
                 companion: Companion | None = None, prompt_cache: PromptCache | None = None):
        self.target, self.draft, self.transform, self.stop_ids = target, draft, transform, set(stop_ids)
        self.companion = companion  # SV's companion predictor, for the rules that read it
        self.prompt_cache = prompt_cache  # prompts' keys and values kept from one decode to the next
        self.vocabulary = output_width(target)  # q is taken over the target's tokens (`fit_vocabulary`)
        self.draft_vocabulary = output_width(draft)
        inputs = draft.get_input_embeddings() if hasattr(draft, "get_input_embeddings") else None
        self.draft_inputs = getattr(inputs, "num_embeddings", None)  # the ids the draft can read
        pad = getattr(draft.config, "pad_token_id", None) if hasattr(draft, "config") else None
        self.stand_in = pad if isinstance(pad, int) and 0 <= pad < (self.draft_inputs or 1) else 0

    def draft_reads(self, tokens: list[int]) -> list[int]:
        """`tokens` as the draft reads them: an id it has no input row for (drawn from the target's extra rows) as
        the stand-in id (module docstring)."""
        if self.draft_inputs is None or (self.vocabulary is not None and self.vocabulary <= self.draft_inputs):
            return tokens
        return [token if token < self.draft_inputs else self.stand_in for token in tokens]

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], rule: StopPolicy, max_new_tokens: int, seeds: list[int],
               head: AcceptanceHead | None = None, batch_size: int | None = None, costs: ServingCosts | None = None,
               log: list[RoundRecord] | None = None, planner: Any = None, stop_check: StopCheck | None = None,
               on_emit: Callable[[int, list[int]], None] | None = None) -> list[DecodeResult]:
        """Up to `max_new_tokens` tokens after each prompt under `rule` (prompt i seeded with `seeds[i]`); `head` is the
        acceptance head or verifier the rule reads. All prompts decode together, or `batch_size` at a time with
        continuous batching (a finished request's row takes the next prompt). `costs` are the cost curves a batch
        rule plans with; `log`, when given, receives one `RoundRecord` per round; `planner` continues a run-time
        adapting rule's state from an earlier decode (`rule.planner(costs)` gives a fresh one). `stop_check(request,
        generated)` ends a request after the first token at which it holds (stop strings, a caller's stopping
        criteria), as a stop token does; `on_emit(request, tokens)` receives each round's new tokens (a streamer)."""
        self._check_rule(rule, head)
        start = time.perf_counter()
        slots = len(prompts) if batch_size is None else max(1, min(batch_size, len(prompts)))
        draft, target = round_caches(self.target, self.draft, slots, head.state_layer if rule.reads_head else None)
        companion = BatchCache(self.companion.model, slots) if rule.reads_companion else None
        block, candidate_cost = draft_block(self.draft), draft_candidate_cost(self.draft)
        batch = ServedBatch(prompts, seeds, max_new_tokens, draft, target, companion, self.prompt_cache,
                            self.companion.cost if companion is not None else 1.0, rule.hindsight, block, candidate_cost)
        planner = rule.planner(costs) if planner is None else planner
        if planner is not None:
            planner.price_draft(block, candidate_cost)  # the draft's forwards as they run: one a candidate, or a block
            for row in batch.live:
                planner.admit(row)
            batch.on_admit = planner.admit
        head = head if rule.reads_head else None
        head_cost = head_forward_cost(head, self.draft) if head is not None else 0.0
        if planner is not None and head is not None:  # the planner prices the head's forwards as the counts do
            planner.price_head(head_cost)
        run = DecodeRun(batch, rule, head, head_cost, candidate_cost, planner, stop_check, on_emit, log)
        while batch.live:
            self._round(run)
        return self._finish(batch.results, start, draft, target)

    def _check_rule(self, rule: StopPolicy, head: AcceptanceHead | None) -> None:
        """Refuse, before any forward, a rule this pair cannot decode or a head the rule cannot read."""
        refuse_for_draft(self.draft, rule, self.prompt_cache, self.companion)
        rule.check_head(head)
        check_decodable_head(head if rule.reads_head else None, self.draft)
        if rule.reads_companion and self.companion is None:
            raise UsageError(f"the {rule.name} rule reads SV's companion predictor; build the engine with a companion "
                             "(eval: --sv-companion-skip-layers)")

    def _round(self, run: DecodeRun) -> None:
        """One round for every live row (module docstring): plan its caps, draft, verify, then accept and account row
        by row; the planner observes the checked candidates before finished rows take new requests."""
        batch = run.batch
        rounds = self._plan_round(run)
        self._draft(rounds, batch.tokens, batch.draft, run.rule, run.head, batch.generators, run.planner, batch.companion)
        checks, logits = self._verify(run, rounds)
        record = RoundRecord(head_cost=run.head_cost, candidate_cost=run.candidate_cost)
        outcomes = {}
        for row, this in rounds.items():
            accepted = self._accept(run, row, this, checks[row], logits.get(row))
            outcomes[row] = accepted.outcomes
            self._account(run, row, this, accepted, record)
        if run.planner is not None:
            run.planner.observe(outcomes)
        batch.refill()  # after `observe`: a new request's history starts empty
        if run.log is not None:
            run.log.append(record)
        for cache in batch.caches:
            cache.trim()

    @staticmethod
    def _plan_round(run: DecodeRun) -> dict[int, RowRound]:
        """Each live row's round, capped by the rule (none for a row its draft cannot draft for yet), by a block
        drafter's block and by the planner; a free draft's proposal is read from the row's verified context."""
        batch, draft, rule, planner = run.batch, run.batch.draft, run.rule, run.planner
        live = batch.live
        caps = {row: rule.cap(batch.room(row)) if draft.can_draft(row) else 0 for row in live}
        if draft.draft_limit() is not None:  # a block drafter drafts at most its block
            caps = {row: min(cap, draft.draft_limit()) for row, cap in caps.items()}
        if planner is not None:
            most = planner.round_cap(len(live), max(caps.values()))
            caps = {row: min(cap, most) for row, cap in caps.items()}
        # a free draft: each row's proposal, read from its verified context, and its verify length from the rule
        caps = plan_free_round(draft, rule, planner, {row: batch.tokens[row] for row in live}, caps)
        return {row: RowRound(cap=caps[row], unread=batch.unread(row)) for row in live}

    def _verify(self, run: DecodeRun, rounds: dict[int, RowRound]) -> tuple[dict[int, int | None], dict[int, Any]]:
        """The candidates each row sends to the target (the planner's verify length, then `rule.verify_from`: the
        first checked one, None for a row that calls no target) and one target forward over the rows that call it;
        per row, the first checked candidate, and per calling row, the target's logits."""
        batch, rule, planner = run.batch, run.rule, run.planner
        lengths = planner.verify_lengths({row: this.seen for row, this in rounds.items()}) if planner else None
        for row, length in (lengths or {}).items():
            rounds[row].keep(length)
        checks = {row: rule.verify_from(this.seen) if this.seen else 0 for row, this in rounds.items()}
        called = [row for row in rounds if checks[row] is not None]
        if not called:
            return checks, {}
        return checks, batch.target.feed(
            {row: batch.tokens[row][batch.target.length(row):] + rounds[row].candidates[: self._fed(rule, rounds[row])]
             for row in called},
            {row: len(rounds[row].candidates) - checks[row] + rule.bonus for row in called})

    def _accept(self, run: DecodeRun, row: int, this: RowRound, check_from: int | None,
                logits: Any) -> Accepted:
        """The row's p/q test of its checked candidates (`logits`: the target's, None when no target was called: every
        candidate stands unverified), then what stands: ended at a stop token, a stop check or max_new_tokens."""
        batch, rule = run.batch, run.rule
        called = logits is not None
        if called:
            accepted, new_token = verify(refuse_non_finite(logits[0], "the target"), this.candidates, this.logq_rows,
                                         check_from, rule.bonus, self.transform, batch.generators[row])
        else:  # every candidate passed unverified
            accepted, new_token = len(this.candidates), None
        check = None if run.stop_check is None else (
            lambda tokens, request=batch.request[row], before=batch.generated[row]: run.stop_check(request, before + tokens))
        checked = accepted
        standing, emitted, ended = self.round_output(this.candidates, checked, new_token, batch.room(row), check)
        if not called:
            return Accepted(standing, emitted, ended, 0, False, [])
        # the checked candidates up to the first rejection, none past the token that ended the request
        observed = min(checked + 1, len(emitted)) if ended else checked + 1
        outcomes = [Outcome(d.index, d.prob, i < checked, d.entropy)
                    for i, d in enumerate(this.seen[check_from: observed], start=check_from)]
        return Accepted(standing, emitted, ended, len(this.candidates) - check_from, True, outcomes)

    @staticmethod
    def _account(run: DecodeRun, row: int, this: RowRound, accepted: Accepted, record: RoundRecord) -> None:
        """The row's round into its request's counts and the round's record; its caches cropped to what stands, its
        prompt stored, its new tokens streamed and added to its request."""
        batch, rule = run.batch, run.rule
        result = batch.result(row)
        count_round(result, this.drafted, accepted.standing, accepted.called, rule.hindsight)
        if run.head is not None:  # what the head's forwards cost (SV's companion is counted at `emit`)
            count_head(result, this.scored, sum(this.scored) * run.head_cost, accepted.called)
            record.head_widths.append(list(this.scored))
        widths = batch.draft.round_widths(this.unread, accepted.standing if rule.hindsight else this.drafted)
        if accepted.called:
            result.draft_widths_per_round.append(widths)
        record.requests.append(batch.request[row])
        record.drafted.append(accepted.standing if rule.hindsight else this.drafted)
        record.verified.append(accepted.standing if rule.hindsight else accepted.verified)
        record.emitted.append(len(accepted.emitted))
        record.draft_widths.append(widths)
        for cache in batch.caches:
            cache.crop_row(row, len(batch.tokens[row]) + accepted.standing)
        batch.remember_prompt(row)
        if run.on_emit is not None and accepted.emitted:
            run.on_emit(batch.request[row], accepted.emitted)
        batch.emit(row, accepted.emitted, accepted.ended)

    @torch.no_grad()
    def store_prompts(self, prompts: list[list[int]], batch_size: int) -> None:
        """Prefill `prompts` (all but their last tokens) into the prompt cache for every model, `batch_size` at a time,
        before any decode: untimed and uncounted, so the decodes that follow all start from stored prompts and none of
        them carries the prefill in its measured time (without a prompt cache, nothing to do; once it is full, the
        rest prefill in their decodes)."""
        if self.prompt_cache is None:
            return
        models = {"draft": self.draft, "target": self.target,
                  **({"companion": self.companion.model} if self.companion is not None else {})}
        for name, model in models.items():
            if getattr(model, "free", False):  # a free draft holds no keys and values
                continue
            todo = list(dict.fromkeys(tuple(p[:-1]) for p in prompts if len(p) > 1))
            todo = [prefix for prefix in todo if not self.prompt_cache.holds(name, model, prefix)]
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                cache = BatchCache(model, len(chunk))
                if not cache.plain_layers():
                    break
                cache.feed({row: self.draft_reads(list(prefix)) if name in ("draft", "companion") else list(prefix)
                            for row, prefix in enumerate(chunk)})
                stored = [self.prompt_cache.put(name, model, prefix, cache.snapshot(row, len(prefix)))
                          for row, prefix in enumerate(chunk)]
                if not all(stored):  # full: prefilling more here would be work no decode gets back
                    break

    def decode_one(self, prompt: list[int], rule: StopPolicy, max_new_tokens: int, seed: int,
                   head: AcceptanceHead | None = None) -> DecodeResult:
        """`decode` of a single prompt (B = 1)."""
        return self.decode([prompt], rule, max_new_tokens, [seed], head)[0]

    @staticmethod
    def _fed(rule: StopPolicy, this: RowRound) -> int:
        """How many of the round's candidates the target reads: all with a bonus (its logits follow the last), else
        all but the last checked one (the target's logits before it are what checks it)."""
        return len(this.candidates) if rule.bonus else len(this.candidates) - 1

    def _draft(self, rounds: dict[int, RowRound], tokens: list[list[int]], draft: BatchCache, rule: StopPolicy,
               head: AcceptanceHead | None, generators: list[torch.Generator], planner: Any = None,
               companion: BatchCache | None = None) -> None:
        """Draft every row's candidates until the rule, the planner or the cap ends its round; the companion, where
        one runs, reads what the draft reads, one forward per draft forward."""
        pending = {row: tokens[row][draft.length(row):] for row in rounds if rounds[row].cap > 0}
        while pending:
            reads = {row: self.draft_reads(fed) for row, fed in pending.items()}
            drawn = self._draw_rows(draft.feed(reads), generators)
            # the companion's cache is fed and cropped with the draft's, so it takes the same tokens
            scores = (self._companion_scores(companion.feed(reads), drawn) if companion is not None
                      else self._head_scores(head, drawn, rounds, draft))
            for row, candidate in drawn.items():
                this = rounds[row]
                this.drafted += 1
                if companion is None and head is not None:
                    this.scored.append(int(row in scores))
                score = scores.get(row, 1.0)
                this.acceptance *= score
                this.candidates.append(candidate.token)
                this.logq_rows.append(candidate.logq_all)
                seen = Drafted(index=len(this.candidates), prob=candidate.signals["prob"],
                               entropy=candidate.signals["entropy"], acceptance=this.acceptance, score=score,
                               ends_output=candidate.token in self.stop_ids, top1=candidate.signals["top1"],
                               margin=candidate.signals["margin"], drafter_score=draft.drafter_score(row),
                               drafter_score_scaled=draft.drafter_score_scaled(row) if rule.reads_drafter_temperatures
                               else None, proposal=round_proposal(draft, row))
                this.seen.append(seen)
                planned = planner is not None and planner.stops(row, seen)  # the capped candidate's score too
                if planned or len(this.candidates) >= this.cap or rule.stop(seen):
                    del pending[row]
                else:
                    pending[row], this.previous = [candidate.token], candidate.signals

    def _draw_rows(self, outputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
                   generators: list[torch.Generator]) -> dict[int, Drawn]:
        """Each fed row's candidate from its last draft logits, drawn with the row's own generator."""
        drawn = {}
        for row, (logits, states) in outputs.items():
            fitted = fit_vocabulary(refuse_non_finite(logits[-1], "the draft"), self.vocabulary)
            logq_all = self.transform.log_probs(fitted)
            token = draw(logq_all, generators[row])
            drawn[row] = Drawn(token, candidate_signals(fitted, logq_all, token, self.transform), logq_all, states[-1])
        return drawn

    def _companion_scores(self, outputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
                          drawn: dict[int, Drawn]) -> dict[int, float]:
        """SV's prediction per drafting row for the candidate just drawn, from the companion's logits at its step."""
        assert self.companion is not None
        return {row: self.companion.score(candidate.logq_all,
                                          self.transform.log_probs(fit_vocabulary(outputs[row][0][-1], self.vocabulary)),
                                          candidate.token)
                for row, candidate in drawn.items()}

    def _head_scores(self, head: AcceptanceHead | None, drawn: dict[int, Drawn], rounds: dict[int, RowRound],
                     draft: BatchCache) -> dict[int, float]:
        """The head's score per drafting row at this step: of the candidate just drafted (an `at_draft` head, or a
        `before_draw` one, with the draft's Markov embedding of the token before it where the head reads one), or of
        the previous one, whose state this forward gave (a `one_step_late` head); none without a head."""
        if head is None:
            return {}
        if head.decides in ("at_draft", "before_draw"):
            rows = list(drawn)
            inputs = [(drawn[r].state, drawn[r].signals, drawn[r].token, len(rounds[r].candidates) + 1) for r in rows]
        else:
            rows = [r for r in drawn if rounds[r].previous is not None]
            inputs = [(drawn[r].state, rounds[r].previous, rounds[r].candidates[-1], len(rounds[r].candidates))
                      for r in rows]
        if not rows:
            return {}
        states, signals, candidates, positions = zip(*inputs)
        markov = [draft.markov_embedding(r) for r in rows] if getattr(head, "markov_rank", 0) else None
        scores = acceptance_batch(head, list(states), list(signals), [self.candidate_embedding(head, t) for t in candidates],
                                  list(positions), markov)
        return dict(zip(rows, scores))

    def candidate_embedding(self, head: AcceptanceHead, token: int) -> torch.Tensor | None:
        """The draft's input embedding of `token`, [1, hidden], as a head that reads the candidate takes it (None for a
        head that does not: `candidate_embedding_size` 0)."""
        if not head.candidate_embedding_size:
            return None
        table = self.draft.get_input_embeddings()
        return table(torch.tensor([token], device=table.weight.device)).float()

    def round_output(self, candidates: list[int], accepted: int, new_token: int | None, room: int,
                     check: Callable[[list[int]], bool] | None = None) -> tuple[int, list[int], bool]:
        """What a round adds to the output: its standing candidates and the target's token, ended at the first stop
        token or the first token at which `check(tokens so far in the round)` holds (the run ends there), and at
        `room` tokens (max_new_tokens); how many candidates stand; and whether the run ended."""
        emitted = (candidates[:accepted] + ([] if new_token is None else [new_token]))[:room]
        ended = False
        for position, token in enumerate(emitted):
            if token in self.stop_ids or (check is not None and check(emitted[: position + 1])):
                emitted, ended = emitted[: position + 1], True
                break
        return min(accepted, len(emitted)), emitted, ended

    @staticmethod
    def _finish(results: list[DecodeResult], start: float, draft: BatchCache, target: BatchCache) -> list[DecodeResult]:
        """Each request's result; the decode's wall and forward time are shared equally by its requests."""
        share = 1.0 / max(len(results), 1)
        wall = time.perf_counter() - start
        for result in results:
            result.seconds = wall * share
            result.time_forwards(draft, target, share)
        return results
