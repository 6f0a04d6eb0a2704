"""Free drafts behind the round engine's draft interface: prompt lookup (n-gram) and suffix drafts
(`specheads.lookup.proposers`), exactly.

`LookupDraft(kind="ngram" | "suffix", ...)` stands where a draft model would (`RoundEngine(target, LookupDraft(),
transform, stop_ids)`); the engine asks it for its cache (`specheads.decoding.features.round_caches`), a
`LookupCache` that holds each row's context instead of keys and values. Before a round drafts, the cache reads each
row's proposal from its verified context (`LookupCache.propose`, called by `plan_free_round`); each draft step then
"feeds" the next proposed token's point mass: q = 1 on the proposed token x (log q = 0 at x, −inf elsewhere), so the
engine's draw gives x and the exact verify (`specheads.decoding.sampler.verify_siblings`) accepts it with probability
p(x) and, on a rejection, resamples from p with x removed, renormalised (at T = 0: x stands iff it is the argmax).

Because every proposed token is a function of the verified context (and, for suffix drafts, of other requests'
outputs, which the row's verify randomness does not touch), a rule may read the whole proposal, its match statistics
and per-position acceptance estimates before choosing how much of it to verify, including nothing
(`StopPolicy.proposal_length`; docs/method.md, "Free drafts"): `plan_free_round` asks it, with the estimates of the
rule's planner where it keeps some (`FreePlanner.estimates`). A row without a proposal drafts nothing: the round is a
plain target step. A free draft runs no forward: its rounds count no draft forwards and price none (c = 0).

Under a suffix draft a row's proposals read the outputs of the other rows (SuffixDecoding's global tree), so its tokens
depend on the batch; each row's distribution stays the target's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from specheads.decoding.cache import BatchCache
from specheads.decoding.online import PassivePlanner
from specheads.lookup.proposers import NO_PROPOSAL, Proposal, SuffixProposer, ngram_propose, suffix_available
from specheads.plumbing.errors import UsageError

DRAFT_KINDS = ("ngram", "suffix")


class Estimator(Protocol):
    """A source of per-position acceptance estimates for a free draft's proposal (a token-only head,
    `specheads.lookup.token_head.TokenHead`, is one): `estimates(proposal)` returns â_k for every proposed token
    k = 1..len(proposal.tokens), the probability that token k is accepted given that tokens 1..k−1 were, from the
    proposal (`specheads.lookup.proposers.Proposal`), a function of the verified context known before the verify."""

    def estimates(self, proposal: Proposal) -> list[float]: ...


@dataclass
class LookupDraft:
    """A free draft of `kind` "ngram" (prompt lookup, also called "lookup": `max_ngram`, `min_ngram`, `match`, as
    `ngram_propose` takes them) or "suffix" (SuffixDecoding's trees, which persist from one decode to the next as SuffixDecoding keeps
    earlier requests' outputs: `max_tree_depth`, `max_spec_factor`, `min_token_prob`)."""

    kind: Literal["ngram", "suffix"] = "ngram"
    max_ngram: int = 3
    min_ngram: int = 1
    match: Literal["earliest", "latest"] = "earliest"
    max_tree_depth: int = 64
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1

    config = None  # no model config: the engine takes q over the target's vocabulary
    free = True  # no forward, no keys and values (the engine's prompt cache skips it)
    cost = 0.0  # a draft forward's cost against the target's: c = 0

    def __post_init__(self) -> None:
        if self.kind == "lookup":  # gen's and the token heads' name for prompt lookup
            self.kind = "ngram"
        if self.kind not in DRAFT_KINDS:
            raise UsageError(f"a free draft is one of {', '.join(DRAFT_KINDS)}, got {self.kind!r}")
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise UsageError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")
        if self.kind == "suffix" and not suffix_available():
            raise UsageError("suffix drafts need arctic-inference: pip install nanobind numpy && pip install "
                             "--no-build-isolation arctic-inference==0.3.0 (sh scripts/install.sh test does)")
        self.suffix = SuffixProposer(self.max_tree_depth, self.max_spec_factor, 0.0, self.min_token_prob) \
            if self.kind == "suffix" else None
        self.requests = itertools.count()  # the proposer's request ids, unique over every decode

    @property
    def name(self) -> str:
        """How reports name it."""
        return "suffix" if self.kind == "suffix" else f"ngram (n {self.min_ngram}-{self.max_ngram}, {self.match} match)"

    def propose(self, request: int, context: Sequence[int], prompt_length: int, k: int) -> Proposal:
        """The proposal of at most `k` tokens after `context` (the request's first `prompt_length` tokens its prompt)."""
        if self.suffix is not None:
            return self.suffix.propose(request, context, k)
        return ngram_propose(context, k, prompt_length, self.max_ngram, self.min_ngram, self.match)

    def draft_cache(self, rows: int, vocabulary: int) -> LookupCache:
        """The round engine's draft cache of `rows` rows over the target's `vocabulary`."""
        return LookupCache(self, rows, vocabulary)

    def refuse(self, rule: Any, companion: Any) -> None:
        """What the round engine cannot do with a free draft, refused in one line before any forward."""
        if companion is not None or getattr(rule, "reads_head", False) or getattr(rule, "hindsight", False):
            raise UsageError(f"the {rule.name} rule reads a draft model's state, SV's companion or the oracle's hindsight, "
                             "which a free draft (prompt lookup, suffix) has none of; use constant_k or a free rule "
                             "(lookup_match, suffix_own, lookup_table, lookup_scores, lookup_plan, lookup_plan_online)")
        if not rule.bonus:
            raise UsageError(f"the {rule.name} rule verifies only some candidates; a free draft verifies every one")


class LookupCache(BatchCache):
    """A free draft's side of the round engine: per row, the context it has read (no keys, no values, no forward) and
    the round's proposal, whose tokens its `feed` gives one point mass at a time (module docstring)."""

    def __init__(self, draft: LookupDraft, rows: int, vocabulary: int) -> None:  # no model: BatchCache's state unneeded
        self.draft, self.vocabulary, self.model, self.state_layer = draft, vocabulary, draft, None
        self.slots: list[list[int]] = [[] for _ in range(rows)]  # each row's context (what `length` counts)
        self.forwards, self.passes, self.forward_seconds = [0] * rows, 0, 0.0
        self.proposals: dict[int, Proposal] = {}
        self.drafted = [0] * rows  # the proposed tokens fed this round
        self.request: list[int | None] = [None] * rows  # the proposer's id of each row's request
        self.prompt_length = [0] * rows
        self.told = [0] * rows  # the verified tokens the proposer has of each row's request

    def plain_layers(self) -> bool:
        return False  # nothing to store in a prompt cache

    def round_widths(self, unread: int, drafted: int) -> list[int]:
        return []  # no forward: nothing to price

    def propose(self, contexts: Mapping[int, list[int]], caps: Mapping[int, int]) -> dict[int, Proposal]:
        """Each row's proposal of at most `caps[row]` tokens after its verified context (`contexts[row]`, the prompt
        and the tokens emitted so far), kept for the round's feeds. A row whose request is new starts it (its context
        is its prompt); the others first give the proposer their newly verified tokens."""
        for row, context in contexts.items():
            if self.request[row] is None:
                self.request[row], self.prompt_length[row] = next(self.draft.requests), len(context)
                if self.draft.suffix is not None:
                    self.draft.suffix.start(self.request[row], context)
            elif self.draft.suffix is not None:
                self.draft.suffix.extend(self.request[row], context[self.told[row]:])
            self.told[row] = len(context)
            cap = caps.get(row, 0)
            self.proposals[row] = (self.draft.propose(self.request[row], context, self.prompt_length[row], cap)
                                   if cap > 0 else NO_PROPOSAL)
            self.drafted[row] = 0
        return {row: self.proposals[row] for row in contexts}

    @torch.no_grad()
    def feed(self, tokens: dict[int, list[int]], logits_rows: dict[int, int] | None = None
             ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Read each row's tokens; per row, the point mass on its next proposed token as logits [1, V] (0 there, −inf
        elsewhere) and an empty state [1, 0]."""
        result = {}
        for row, fed in tokens.items():
            self.slots[row].extend(fed)
            token = self.proposals[row].tokens[self.drafted[row]]
            self.drafted[row] += 1
            logits = torch.full((1, self.vocabulary), -math.inf)
            logits[0, token] = 0.0
            result[row] = (logits, torch.zeros(1, 0))
        return result

    def crop_row(self, row: int, length: int) -> None:
        """Keep the row's first `length` tokens; 0 ends its request (a suffix draft's output stays in its global
        tree, with the candidates its last round accepted; the target's last token never reaches it)."""
        if length == 0 and self.request[row] is not None:
            if self.draft.suffix is not None:
                self.draft.suffix.extend(self.request[row], self.slots[row][self.told[row]:])
                self.draft.suffix.stop(self.request[row])
            self.request[row] = None
        del self.slots[row][length:]

    def trim(self) -> None:
        """Nothing to crop: a context is a list."""


class FreePlanner(PassivePlanner):
    """The planner of a free rule: per row, the proposal it planned this round and how much of it;
    `estimates` gives â_k per proposed token (none here: subclasses keep them: vLLM's table, a head, the proposal's
    own scores)."""

    def __init__(self) -> None:
        self.planned: dict[int, Proposal] = {}
        self.lengths: dict[int, int] = {}

    def admit(self, row: int) -> None:
        self.planned.pop(row, None)

    def estimates(self, row: int, proposal: Proposal) -> list[float] | None:
        """â_k for each token of `proposal`, the row's proposal this round; None: this planner keeps none."""
        return None

    def proposal_length(self, row: int, proposal: Proposal, rule: Any) -> int:
        """The row's verify length this round: the rule's choice from the whole proposal and this planner's
        estimates (`StopPolicy.proposal_length`)."""
        return int(rule.proposal_length(proposal, self.estimates(row, proposal)))

    def plan(self, row: int, proposal: Proposal, length: int) -> None:
        """The row verifies the first `length` tokens of `proposal` this round."""
        self.planned[row], self.lengths[row] = proposal, length

    def observe(self, outcomes: Mapping[int, list[Any]]) -> None:
        self.lengths = {}


def plan_free_round(draft: BatchCache, rule: Any, planner: Any, contexts: Mapping[int, list[int]],
                    caps: dict[int, int]) -> dict[int, int]:
    """For a free draft's cache, each row's proposal read from its verified context (`contexts`) and its verify
    length chosen by the rule from the whole proposal and the planner's estimates (`StopPolicy.proposal_length`), as
    the row's cap this round; `caps` unchanged for a draft model's cache."""
    if not isinstance(draft, LookupCache):
        return caps
    proposals = draft.propose(contexts, caps)
    planned = dict(caps)
    for row, proposal in proposals.items():
        chosen = (planner.proposal_length(row, proposal, rule) if isinstance(planner, FreePlanner)
                  else rule.proposal_length(proposal, None)) if proposal.tokens else 0
        length = max(0, min(int(chosen), len(proposal.tokens), caps[row]))
        if isinstance(planner, FreePlanner):
            planner.plan(row, proposal, length)
        planned[row] = length
    return planned


def round_proposal(draft: BatchCache, row: int) -> Proposal | None:
    """The row's proposal this round under a free draft (what a rule reads beside each drafted candidate,
    `Drafted.proposal`); None under a draft model."""
    return draft.proposals.get(row) if isinstance(draft, LookupCache) else None
