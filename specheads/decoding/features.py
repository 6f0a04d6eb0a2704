"""What the drafts that read the target's features share (`specheads.decoding.eagle3`, `specheads.decoding.dspark`):
the target with its streams kept (one request, `FeatureTarget`; B rows, `StreamBatchCache`), a drafter's head placed
over the target's vocabulary (`FullVocabularyHead`), the face such a drafter shows the round engine (`FeatureDraft`),
and a B = 1 loop's counts (`DrafterResult`).

The round engine and the tree engine ask a draft for its caches (`round_caches`, `tree_caches`) and what it cannot do
yet (`refuse_for_draft`); a plain causal LM gets `BatchCache`s, a `FeatureDraft` its own, so neither engine branches on
a drafter's algorithm.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from specheads.decoding.cache import BatchCache
from specheads.decoding.free_draft import LookupDraft
from specheads.decoding.sampler import draw, refuse_non_finite, verify
from specheads.model_outputs.sampling import SamplingTransform
from specheads.model_outputs.signals import output_width
from specheads.pair.drafters import candidate_weights, draft_rows, forward_weights, streams_captured
from specheads.plumbing.errors import UsageError


@dataclass
class DrafterResult:
    """One request's output and counts: tokens emitted, rounds, forwards of each model, per drafted position k
    (0-based) how many rounds reached it and how many accepted its candidate, and, for a drafter that predicts its own
    acceptance (DSpark's confidence head), that prediction for each drafted position of each round."""

    tokens: list[int] = field(default_factory=list)
    rounds: int = 0
    target_calls: int = 0
    draft_forwards: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    confidence: list[list[float]] = field(default_factory=list)
    seconds: float = 0.0

    def acceptance_per_position(self) -> list[float]:
        """The share of rounds that reached drafted position k and accepted its candidate."""
        return [a / r if r else math.nan for a, r in zip(self.accepted, self.reached)]

    def count_round(self, drafted: int, stood: int) -> None:
        """Add a round that drafted `drafted` candidates, of which the first `stood` stand."""
        for k in range(drafted):
            self.reached[k] += k <= stood
            self.accepted[k] += k < stood


class FeatureTarget:
    """The target with a KV cache that keeps, for every position it has read, the streams a drafter reads."""

    def __init__(self, target: Any, layer_ids: list[int]) -> None:
        self.target, self.layer_ids = target, layer_ids
        self.cache = DynamicCache(config=target.config)
        self.features: torch.Tensor | None = None  # [positions read, n·h]
        self.calls = 0

    @property
    def length(self) -> int:
        """Positions read: 0..length − 1."""
        return self.cache.get_seq_length()

    @torch.no_grad()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Read `tokens` after the positions held; their float32 logits [m, V]. Their features join `features`."""
        device = next(self.target.parameters()).device
        start = self.length
        positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
        with streams_captured(self.target, self.layer_ids) as captured:
            output = self.target(input_ids=torch.tensor([tokens], device=device), position_ids=positions,
                                 past_key_values=self.cache, use_cache=True)
        fused = torch.cat([captured[index] for index in self.layer_ids], dim=-1)[0]
        self.features = fused if self.features is None else torch.cat([self.features, fused])
        self.calls += 1
        return refuse_non_finite(output.logits[0].float(), "the target")

    def crop(self, length: int) -> None:
        """Keep positions 0..length − 1 (cache and features)."""
        held = self.length
        if held > length:
            self.cache.crop(length - held)
            self.features = self.features[:length]


class Proposer(Protocol):
    """A drafter's side of `chain_decode`: its candidates for a round, and its forwards so far."""

    forwards: int

    def propose(self, verifier: FeatureTarget, tokens: list[int], drafting: int, transform: SamplingTransform,
                generator: torch.Generator) -> tuple[list[int], list[torch.Tensor], list[float]]:
        """(`drafting` candidates after `tokens`, each drawn with `generator` from the log q it is returned with; the
        drafter's own prediction of each one's acceptance, or none). The target has read all of `tokens` but the last
        (`verifier.features`)."""
        ...


def chain_decode(target: Any, layer_ids: list[int], draft: Proposer, prompt: list[int], transform: SamplingTransform,
                 max_draft: int, max_new_tokens: int, seed: int, stop_ids: list[int] | tuple[int, ...] = ()
                 ) -> DrafterResult:
    """One request decoded by a feature drafter alone, B = 1 (the reference the round engine is tested against): the
    target reads the prompt and draws the first token; then each round `draft` proposes up to `max_draft` candidates
    (fewer where the request has less room: the token after them fills the last slot), the target checks them in one
    forward (`specheads.decoding.sampler.verify`), and the standing candidates and the token after them are emitted,
    ended at a stop token and at `max_new_tokens`."""
    began = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    result = DrafterResult(reached=[0] * max_draft, accepted=[0] * max_draft)
    verifier = FeatureTarget(target, layer_ids)
    tokens = list(prompt)
    first = draw(transform.log_probs(verifier.feed(tokens)[-1]), generator)
    tokens.append(first)
    result.tokens.append(first)
    while len(result.tokens) < max_new_tokens and result.tokens[-1] not in stop_ids:
        standing = len(tokens)
        drafting = min(max_draft, max_new_tokens - len(result.tokens) - 1)
        candidates, log_qs, scores = draft.propose(verifier, tokens, drafting, transform, generator) if drafting > 0 else (
            [], [], [])
        if log_qs:  # the drafter's forwards of this round, checked at once
            refuse_non_finite(torch.stack(log_qs), "the drafter")
        stood, new = verify(verifier.feed([tokens[-1], *candidates]), candidates, log_qs, 0, True, transform, generator)
        result.count_round(drafting, stood)
        if scores:
            result.confidence.append(scores)
        emitted = [*candidates[:stood], new]
        verifier.crop(standing + stood)
        tokens += emitted
        for token in emitted:
            if len(result.tokens) < max_new_tokens and result.tokens[-1] not in stop_ids:
                result.tokens.append(token)
        result.rounds += 1
    result.target_calls, result.draft_forwards = verifier.calls, draft.forwards
    result.seconds = time.perf_counter() - began
    return result


def place_logits(logits: torch.Tensor, rows: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """Logits over a draft vocabulary [..., V_d] at their `rows` of the target's [..., V], −inf elsewhere (q is then
    zero off the draft vocabulary)."""
    full = logits.new_full((*logits.shape[:-1], vocabulary), -math.inf)
    return full.index_copy_(-1, rows.to(logits.device), logits)


def additive_mask(attention_mask: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4D mask of a `BatchCache` forward of `count` new tokens: a tree's (`BatchCache.feed_trees`), as it
    is, or from the 2D slot mask [B, slots], the slots each row holds and causal among the new tokens (a padded query
    sees itself: no empty row)."""
    if attention_mask.dim() == 4:
        return attention_mask.to(dtype)
    used = attention_mask.shape[1] - count
    keys = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    queries = used + torch.arange(count, device=attention_mask.device)
    allowed = attention_mask.bool()[:, None, None, :] & (keys[None, :] <= queries[:, None])[None, None]
    allowed |= (keys[None, :] == queries[:, None])[None, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device).masked_fill_(~allowed, -math.inf)


class FullVocabularyHead(torch.nn.Module):
    """A drafter's LM head with its logits placed at their rows of the target's vocabulary (`rows`), −inf elsewhere (q
    is then zero off the draft vocabulary). `weight` has the target's rows and no columns: what `output_width` reads."""

    def __init__(self, lm_head: torch.nn.Linear, rows: torch.Tensor, vocabulary: int) -> None:
        super().__init__()
        self.lm_head, self.vocabulary = lm_head, vocabulary
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("weight", lm_head.weight.new_zeros(vocabulary, 0), persistent=False)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return place_logits(self.lm_head(states), self.rows, self.vocabulary)


class StreamBatchCache(BatchCache):
    """The target's `BatchCache` that also keeps, per row and position, the streams a drafter reads."""

    def __init__(self, model: Any, rows: int, layer_ids: list[int]) -> None:
        super().__init__(model, rows)
        self.layer_ids = layer_ids
        self.streams: list[torch.Tensor | None] = [None] * rows
        self.by_slot: dict[tuple[int, int], torch.Tensor] = {}  # the last tree feed's streams, by (row, slot)

    def feed(self, tokens: dict[int, list[int]], logits_rows: dict[int, int] | None = None
             ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        before = {row: self.length(row) for row in tokens}
        with streams_captured(self.model, self.layer_ids) as captured:
            result = super().feed(tokens, logits_rows)
        fused = torch.cat([captured[index] for index in self.layer_ids], dim=-1)
        for row, fed in tokens.items():
            kept = self.streams[row][: before[row]] if self.streams[row] is not None else fused[row, :0]
            self.streams[row] = torch.cat([kept, fused[row, : len(fed)]])
        return result

    def crop_row(self, row: int, length: int) -> None:
        super().crop_row(row, length)
        if self.streams[row] is not None:
            self.streams[row] = self.streams[row][:length]

    def feed_trees(self, trees: dict[int, tuple[list[int], list[int], list[list[int]]]],
                   logits_from: dict[int, int] | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]]:
        """`BatchCache.feed_trees`, keeping each fed token's streams by its slot until `hold` makes it the row's."""
        with streams_captured(self.model, self.layer_ids) as captured:
            result = super().feed_trees(trees, logits_from)
        fused = torch.cat([captured[index] for index in self.layer_ids], dim=-1)
        self.by_slot = {(row, slot): fused[row, index] for row in trees for index, slot in enumerate(result[row][2])}
        return result

    def hold(self, row: int, slots: list[int]) -> None:
        super().hold(row, slots)
        held = [self.by_slot[(row, slot)] for slot in slots]
        if held:
            kept = self.streams[row] if self.streams[row] is not None else held[0].new_zeros(0, held[0].shape[-1])
            self.streams[row] = torch.cat([kept, torch.stack(held)])


class FeatureDraft(torch.nn.Module):
    """A drafter that reads the target's streams at `layer_ids`, with the face of a causal LM over the target's
    vocabulary, as the round engine's draft: its layers run as `decoder`, its head over the target's rows. Subclasses
    set `kind` (how messages name it) and make the drafter's cache of B rows beside the target's (`draft_cache`)."""

    kind: str = ""
    block: int | None = None  # the forward shape (`specheads.decoding.costs.ServingCosts.block`): one forward a
    # candidate, or one over a block of this many slots a round
    scores: bool = False  # whether it predicts each candidate's acceptance before the draw (`BatchCache.drafter_score`)

    def __init__(self, drafter: Any, target: Any, layer_ids: list[int], decoder: torch.nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self.layer_ids = list(layer_ids)
        self.config = drafter.config.transformer_layer_config
        self.config.pad_token_id = target.config.pad_token_id
        self.decoder = decoder
        self.embeddings = drafter.embed_tokens
        self.head = FullVocabularyHead(drafter.lm_head, draft_rows(drafter), target.config.vocab_size)

    def forward_weights(self) -> int:
        """The weights one drafter forward multiplies per token it reads (`specheads.pair.drafters.forward_weights`):
        what a draft forward and a head's share of it are priced by."""
        return forward_weights(self.drafter)

    @property
    def candidate_cost(self) -> float:
        """Each candidate drawn after the forward (a DSpark drafter's Markov bias and confidence head), in draft
        forwards: its weights over a forward's (`specheads.pair.drafters.candidate_weights`); 0 for EAGLE-3."""
        return candidate_weights(self.drafter) / self.forward_weights()

    def get_decoder(self) -> torch.nn.Module:
        return self.decoder

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embeddings

    def get_output_embeddings(self) -> FullVocabularyHead:
        return self.head

    def draft_cache(self, target: StreamBatchCache, rows: int, state_layer: int | None = None,
                    target_row: int | None = None) -> BatchCache:
        """The drafter's cache of `rows` rows, reading `target`'s streams (a tree request's cache: one row reading the
        target's row `target_row`)."""
        raise NotImplementedError

    def own_rule(self) -> Any:
        """The chain rule this draft decodes by when no head is given (`speculative_generate`); None: it needs one."""
        return None

    def refuse(self, rule: Any, prompt_cache: Any, companion: Any) -> None:
        """What the round engine cannot do yet with this draft, refused in one line before any forward."""
        if not rule.bonus:
            raise UsageError(f"the {rule.name} rule earns no bonus token, which {self.kind} draft's first round needs; "
                             "use a stop rule (constant_k, confidence, svip, head)")
        if prompt_cache is not None or companion is not None:
            raise UsageError(f"{self.kind} draft runs without a prompt cache or SV's companion for now; build the engine "
                             "without them")


def round_caches(target: Any, draft: Any, rows: int, state_layer: int | None) -> tuple[BatchCache, BatchCache]:
    """(the draft's cache, the target's) for a round engine: plain `BatchCache`s, or a feature draft's pair."""
    if isinstance(draft, FeatureDraft):
        target_cache = StreamBatchCache(target, rows, draft.layer_ids)
        return draft.draft_cache(target_cache, rows, state_layer), target_cache
    if isinstance(draft, LookupDraft):
        return draft.draft_cache(rows, output_width(target)), BatchCache(target, rows)
    return BatchCache(draft, rows, state_layer), BatchCache(target, rows)


def tree_caches(engine_target: Any, engine_draft: Any, rows: int) -> tuple[BatchCache, Any]:
    """(the shared target cache of a tree decode, a maker of each request's own draft cache: (target row, state layer)
    -> cache), plain or a feature draft's."""
    if isinstance(engine_draft, LookupDraft):
        raise UsageError("tree drafts need a draft model or a feature drafter; a free draft (prompt lookup, suffix) "
                         "proposes one chain: decode it without a tree")
    if isinstance(engine_draft, FeatureDraft):
        target = StreamBatchCache(engine_target, rows, engine_draft.layer_ids)
        return target, lambda row, state_layer: engine_draft.draft_cache(target, 1, state_layer, target_row=row)
    return BatchCache(engine_target, rows), lambda row, state_layer: BatchCache(engine_draft, 1, state_layer)


def draft_block(draft: Any) -> int | None:
    """The forward shape of `draft` (`FeatureDraft.block`): None for a draft of one forward a candidate."""
    return draft.block if isinstance(draft, FeatureDraft) else None


def draft_candidate_cost(draft: Any) -> float:
    """What `draft` computes for each candidate after its forward, in draft forwards (`FeatureDraft.candidate_cost`: a
    DSpark drafter's Markov bias); 0 for a causal LM, whose forward gives the candidate's q."""
    return draft.candidate_cost if isinstance(draft, FeatureDraft) else 0.0


def refuse_for_draft(draft: Any, rule: Any, prompt_cache: Any, companion: Any) -> None:
    """What the round engine cannot do yet with `draft` (a feature draft's `refuse`; nothing for a causal LM), and a
    rule reading the drafter's own prediction (`reads_drafter_score`) with a draft that makes none."""
    if getattr(rule, "reads_drafter_score", False) and not (isinstance(draft, FeatureDraft) and draft.scores):
        raise UsageError(f"the {rule.name} rule reads a DSpark drafter's confidence head, which this draft does not "
                         "have; decode it with a DSpark drafter trained with its confidence head, or use another rule")
    if getattr(rule, "reads_drafter_temperatures", False) and getattr(draft, "score_temperatures", None) is None:
        raise UsageError(f"the {rule.name} rule reads the DSpark drafter's confidence through per-position "
                         "temperatures, and this draft was given none; fit them (eval --dspark fits them on the head's "
                         "calibration prompts) or use dspark_confidence / dspark_adaptive")
    if isinstance(draft, FeatureDraft):
        draft.refuse(rule, prompt_cache, companion)
    if isinstance(draft, LookupDraft):
        draft.refuse(rule, companion)
