"""EAGLE-3 drafts, exactly: an EAGLE-3 drafter (`specheads.pair.eagle3`) fed as vLLM's EAGLE-3 proposer feeds it, in
a chain loop for one request (`eagle3_decode`) and behind the round engine's caches (`Eagle3Model`: B rows, continuous
batching, every chain rule with a bonus token, and token trees through `decode_tree`).

Positions count the request's tokens from 0. The drafter's entry at position t reads token x_t with a feature of
position t − 1: the target's three fused streams (projected by `fc`) where the target has read position t − 1, else
the drafter's own state at t − 1 (its decoder output, normed where the drafter was trained so). A round, with
x_0..x_{n−1} standing and the target holding positions 0..n − 2:

1. **catch-up**: the drafter reads positions it lacks up to n − 1 with the target's features, one forward; its last
   row is q for x_n;
2. **draft**: K candidates (fewer where the request has less room: the token after them fills the last slot), each
   drawn from q and read back with the drafter's own state, one forward each but the last. q is over the target's
   vocabulary: the drafter's logits at their d2t rows, −inf elsewhere, then the sampling transform, so a token
   outside the draft vocabulary has q = 0;
3. **verify**: one target forward over x_{n−1} and the candidates, the p/q test of each
   (`specheads.decoding.sampler.verify`), the token after; the target's features of the positions that stand are
   kept, and the drafter's entries from its own states are dropped (vLLM recomputes the accepted positions with the
   target's features in the next catch-up).

A request's first round drafts nothing: the drafter needs the target's streams of the prompt. Each q is computed from
the verified prefix, its target features and the candidates drawn before it, so the output follows the target's
distribution (docs/method.md); greedy (T = 0) gives the target's greedy tokens. A tree's node is read with its
parent's own state (a first-level node with the last position's), and none is held: the accepted path is read again
with the target's streams. The prompt cache and SV's companion do not run with this draft yet.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from specheads.decoding.cache import BatchCache
from specheads.decoding.sampler import draw, verify
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.eagle3 import draft_to_target, drafter_forward, fused_streams, streams_captured
from specheads.plumbing.errors import UsageError


@dataclass
class Eagle3Result:
    """One request's output and counts: tokens emitted, rounds, forwards of each model, and per drafted position k
    (0-based) how many rounds reached it and how many accepted its candidate."""

    tokens: list[int] = field(default_factory=list)
    rounds: int = 0
    target_calls: int = 0
    draft_forwards: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def acceptance_per_position(self) -> list[float]:
        """The share of rounds that reached drafted position k and accepted its candidate."""
        return [a / r if r else math.nan for a, r in zip(self.accepted, self.reached)]


class Eagle3Draft:
    """A drafter with its own KV cache for one request: `feed` reads tokens with the target's fused features or the
    drafter's own states, `crop` forgets entries, `log_q` gives q over the target's vocabulary."""

    def __init__(self, drafter: Any, target_vocabulary: int) -> None:
        self.drafter = drafter
        self.rows = draft_to_target(drafter.d2t)
        self.vocabulary = target_vocabulary
        self.cache = DynamicCache()
        self.first_position = 1  # the drafter's entry for position t needs a feature of t − 1: none for t = 0
        self.forwards = 0

    @property
    def length(self) -> int:
        """Positions held: 1..length."""
        return self.cache.get_seq_length()

    @torch.no_grad()
    def feed(self, tokens: list[int], features: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Read `tokens` at the positions after those held, each with its feature row (the target's three streams
        when `fused`, else the drafter's own states); (the logits over the draft vocabulary [m, V_d], the states to
        feed back [m, h])."""
        drafter = self.drafter
        start, count, held = self.first_position + self.length, len(tokens), self.length
        ids = torch.tensor([tokens], device=features.device)
        rows = drafter.fc(features.unsqueeze(0)) if fused else features.unsqueeze(0)
        positions = torch.arange(start, start + count, device=features.device).unsqueeze(0)
        mask = torch.full((count, held + count), -math.inf, dtype=drafter.embed_tokens.weight.dtype,
                          device=features.device)
        mask = torch.triu(mask, diagonal=held + 1)[None, None]  # each token sees what is held and itself
        normed, own = drafter_forward(drafter, ids, rows, mask, positions, self.cache)
        self.forwards += 1
        return drafter.lm_head(normed)[0].float(), own[0]

    def crop(self, length: int) -> None:
        """Keep the entries of positions 1..length."""
        if self.length > length:
            self.cache.crop(length - self.length)

    def log_q(self, logits: torch.Tensor, transform: SamplingTransform) -> torch.Tensor:
        """q over the target's vocabulary after `transform`: the draft logits at their d2t rows, −inf elsewhere."""
        full = torch.full((self.vocabulary,), -math.inf, dtype=torch.float32, device=logits.device)
        full[self.rows.to(logits.device)] = logits
        return transform.log_probs(full)


class Eagle3Target:
    """The target with a KV cache that keeps, for every position it has read, the three streams the drafter fuses."""

    def __init__(self, target: Any, layer_ids: list[int]) -> None:
        self.target, self.layer_ids = target, layer_ids
        self.cache = DynamicCache(config=target.config)
        self.features: torch.Tensor | None = None  # [positions read, 3h]
        self.calls = 0

    @torch.no_grad()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Read `tokens` after the positions held; their float32 logits [m, V]. Their features join `features`."""
        device = next(self.target.parameters()).device
        start = self.cache.get_seq_length()
        positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
        with streams_captured(self.target, self.layer_ids) as captured:
            output = self.target(input_ids=torch.tensor([tokens], device=device), position_ids=positions,
                                 past_key_values=self.cache, use_cache=True)
        fused = fused_streams(captured, self.layer_ids)[0]
        self.features = fused if self.features is None else torch.cat([self.features, fused])
        self.calls += 1
        return output.logits[0].float()

    def crop(self, length: int) -> None:
        """Keep positions 0..length − 1 (cache and features)."""
        held = self.cache.get_seq_length()
        if held > length:
            self.cache.crop(length - held)
            self.features = self.features[:length]


def eagle3_decode(target: Any, drafter: Any, prompt: list[int], transform: SamplingTransform, max_draft: int,
                  max_new_tokens: int, seed: int, stop_ids: list[int] | tuple[int, ...] = ()) -> Eagle3Result:
    """Decode one request with `drafter` drafting `max_draft` candidates a round (see the module docstring)."""
    began = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    result = Eagle3Result(reached=[0] * max_draft, accepted=[0] * max_draft)
    verifier = Eagle3Target(target, drafter.config.eagle_aux_hidden_state_layer_ids)
    draft = Eagle3Draft(drafter, target.config.vocab_size)
    tokens = list(prompt)
    first = draw(transform.log_probs(verifier.feed(tokens)[-1]), generator)
    tokens.append(first)
    result.tokens.append(first)
    while len(result.tokens) < max_new_tokens and result.tokens[-1] not in stop_ids:
        standing = len(tokens)
        drafting = min(max_draft, max_new_tokens - len(result.tokens) - 1)  # the bonus token fills the last slot
        candidates, log_qs = [], []
        if drafting > 0:
            catch_up = tokens[draft.first_position + draft.length:]
            logits, own = draft.feed(catch_up, verifier.features[draft.length:standing - 1], fused=True)
        for k in range(drafting):
            log_q = draft.log_q(logits[-1], transform)
            candidates.append(draw(log_q, generator))
            log_qs.append(log_q)
            if k + 1 < drafting:
                logits, own = draft.feed(candidates[-1:], own[-1:], fused=False)
        p_logits = verifier.feed([tokens[-1], *candidates])
        stood, new = verify(p_logits, candidates, log_qs, 0, True, transform, generator)
        for k in range(drafting):
            result.reached[k] += k <= stood
            result.accepted[k] += k < stood
        emitted = [*candidates[:stood], new]
        verifier.crop(standing + stood)
        draft.crop(standing - draft.first_position)
        tokens += emitted
        for token in emitted:
            if len(result.tokens) < max_new_tokens and result.tokens[-1] not in stop_ids:
                result.tokens.append(token)
        result.rounds += 1
    result.target_calls, result.draft_forwards = verifier.calls, draft.forwards
    result.seconds = time.perf_counter() - began
    return result


# ---- the same draft behind the round engine's caches (`specheads.decoding.engine.RoundEngine`, B rows)


class FullVocabularyHead(torch.nn.Module):
    """The drafter's LM head with its logits placed at their d2t rows of the target's vocabulary, −inf elsewhere (q
    is then zero off the draft vocabulary). `weight` has the target's rows and no columns: what `output_width` reads."""

    def __init__(self, lm_head: torch.nn.Linear, rows: torch.Tensor, vocabulary: int) -> None:
        super().__init__()
        self.lm_head, self.vocabulary = lm_head, vocabulary
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("weight", lm_head.weight.new_zeros(vocabulary, 0), persistent=False)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(states)
        full = logits.new_full((*logits.shape[:-1], self.vocabulary), -math.inf)
        return full.index_copy_(-1, self.rows, logits)


class Eagle3Decoder(torch.nn.Module):
    """The drafter as a decoder `BatchCache` runs: its inputs' feature rows are set in `features` before each forward
    (`Eagle3BatchCache.feed`); returns the normed states (what its head reads) and keeps the states a drafted token
    feeds back in `own`."""

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        self.drafter = drafter
        self.layers = drafter.layers
        self.features: torch.Tensor | None = None  # [B, m, h]: fc of the target's streams, or own states
        self.own: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                use_cache: bool = True, past_key_values: Any = None) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        drafter, cache = self.drafter, past_key_values if past_key_values is not None else DynamicCache()
        count, dtype = input_ids.shape[1], drafter.embed_tokens.weight.dtype
        # no features set: a plain `BatchCache` timing the drafter's forward (`specheads profile`): zeros cost the same
        features = self.features if self.features is not None else torch.zeros(
            *input_ids.shape, drafter.embed_tokens.embedding_dim, dtype=dtype, device=input_ids.device)
        if attention_mask.dim() == 4:  # a tree's mask (`BatchCache.feed_trees`), additive already
            mask = attention_mask.to(dtype)
        else:  # the slots each row holds, and causal among the new tokens
            used = attention_mask.shape[1] - count
            keys = torch.arange(attention_mask.shape[1], device=input_ids.device)
            queries = used + torch.arange(count, device=input_ids.device)
            allowed = attention_mask.bool()[:, None, None, :] & (keys[None, :] <= queries[:, None])[None, None]
            allowed |= (keys[None, :] == queries[:, None])[None, None]  # a padded query sees itself: no empty row
            mask = torch.zeros(allowed.shape, dtype=dtype, device=input_ids.device).masked_fill_(~allowed, -math.inf)
        normed, self.own = drafter_forward(drafter, input_ids, features, mask, position_ids, cache)
        return BaseModelOutputWithPast(last_hidden_state=normed, past_key_values=cache)


class Eagle3Model(torch.nn.Module):
    """An EAGLE-3 drafter with the face of a causal LM over the target's vocabulary, as the round engine's draft:
    `RoundEngine(target, Eagle3Model(drafter, target), ...)` decodes with it exactly (`Eagle3BatchCache`)."""

    def __init__(self, drafter: Any, target: Any) -> None:
        super().__init__()
        self.drafter = drafter
        self.layer_ids = list(drafter.config.eagle_aux_hidden_state_layer_ids)
        self.config = drafter.config.transformer_layer_config
        self.config.pad_token_id = target.config.pad_token_id
        self.decoder = Eagle3Decoder(drafter)
        self.head = FullVocabularyHead(drafter.lm_head, draft_to_target(drafter.d2t), target.config.vocab_size)

    def get_decoder(self) -> Eagle3Decoder:
        return self.decoder

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.drafter.embed_tokens

    def get_output_embeddings(self) -> FullVocabularyHead:
        return self.head


class StreamBatchCache(BatchCache):
    """The target's `BatchCache` that also keeps, per row and position, the three streams an EAGLE-3 drafter fuses."""

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
        fused = fused_streams(captured, self.layer_ids)
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
        fused = fused_streams(captured, self.layer_ids)
        self.by_slot = {(row, slot): fused[row, index] for row in trees for index, slot in enumerate(result[row][2])}
        return result

    def hold(self, row: int, slots: list[int]) -> None:
        super().hold(row, slots)
        held = [self.by_slot[(row, slot)] for slot in slots]
        if held:
            kept = self.streams[row] if self.streams[row] is not None else held[0].new_zeros(0, held[0].shape[-1])
            self.streams[row] = torch.cat([kept, torch.stack(held)])


class Eagle3BatchCache(BatchCache):
    """The drafter's `BatchCache`: a token at position t is read with the target's streams of t − 1 where the target
    has read t − 1, else with the drafter's own state there (the module docstring's rounds, for B rows). Position 0
    has no entry; a row's entries read from its own states are dropped when the row is cropped, so the accepted tokens
    are read again with the target's streams, as vLLM's proposer does."""

    def __init__(self, model: Eagle3Model, rows: int, target: StreamBatchCache, state_layer: int | None = None,
                 target_row: int | None = None) -> None:
        super().__init__(model, rows, state_layer)
        self.target = target
        self.target_row = target_row  # a tree request's own cache (one row) reads this row of the shared target's
        self.own_by_slot: dict[int, torch.Tensor] = {}  # a tree's nodes' own states, by their slots
        self.started = [False] * rows  # whether position 0 is held (it takes no entry)
        self.from_target = [0] * rows  # entries read with the target's streams
        self.own: list[torch.Tensor | None] = [None] * rows  # the own state of the row's last position

    def length(self, row: int) -> int:
        return len(self.slots[row]) + self.started[row]

    @property
    def lengths(self) -> list[int]:
        return [self.length(row) for row in range(len(self.slots))]

    def of_target(self, row: int) -> int:
        """The target's row that `row` drafts for."""
        return row if self.target_row is None else self.target_row

    def can_draft(self, row: int) -> bool:
        """Only once the target has read the row's prompt: its first q needs the target's streams."""
        return self.target.length(self.of_target(row)) > 0

    def feed(self, tokens: dict[int, list[int]], logits_rows: dict[int, int] | None = None
             ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        decoder = self.model.get_decoder()
        self.own_by_slot.clear()  # a catch-up or a chain's step: no tree node is an ancestor any more
        fed, features, caught_up = {}, {}, {}
        for row, row_tokens in tokens.items():
            if not self.started[row]:
                self.started[row], row_tokens = True, row_tokens[1:]
            start = self.length(row)
            streams, held = self.target.streams[self.of_target(row)], self.target.length(self.of_target(row))
            read = min(max(held - (start - 1), 0), len(row_tokens))  # positions with the target's streams
            if read == len(row_tokens):  # a catch-up: every position before these is the target's
                caught_up[row] = streams[start - 1: start - 1 + read]
                self.from_target[row] += read if len(self.slots[row]) == self.from_target[row] else 0
            elif len(row_tokens) == 1 and self.own[row] is not None:  # a drafted token after the last position
                features[row] = self.own[row][None]
            else:
                raise RuntimeError("an EAGLE-3 draft reads its own state only for one token after its last position")
            fed[row] = row_tokens
        if caught_up:  # every catching-up row's streams fused in one `fc`
            fused = decoder.drafter.fc(torch.cat(list(caught_up.values())).to(self.device))
            features.update(zip(caught_up, fused.split([len(streams) for streams in caught_up.values()])))
        width = max(len(row_tokens) for row_tokens in fed.values())
        size = next(iter(features.values())).shape[-1]
        padded = torch.zeros(len(self.slots), width, size, device=self.device)
        for row, rows_features in features.items():
            padded[row, : len(rows_features)] = rows_features
        decoder.features = padded
        try:
            result = super().feed(fed, {row: min((logits_rows or {}).get(row, 1), len(fed[row])) for row in fed})
        finally:
            decoder.features = None
        for row, row_tokens in fed.items():
            self.own[row] = decoder.own[row, len(row_tokens) - 1]
        return result

    def feed_trees(self, trees: dict[int, tuple[list[int], list[int], list[list[int]]]],
                   logits_from: dict[int, int] | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]]:
        """A tree's nodes, each read with its parent's own state (the last held position's for a first-level node);
        they are never held (`hold`): the accepted ones are read again with the target's streams."""
        decoder = self.model.get_decoder()
        width = max(len(tokens) for tokens, _, _ in trees.values())
        size = decoder.drafter.config.transformer_layer_config.hidden_size
        padded = torch.zeros(len(self.slots), width, size, device=self.device)
        for row, (_, _, sees) in trees.items():
            for index, seen in enumerate(sees):
                parent = next((self.own_by_slot[slot] for slot in reversed(seen) if slot in self.own_by_slot), None)
                padded[row, index] = self.own[row] if parent is None else parent
        decoder.features = padded
        try:
            result = super().feed_trees(trees, logits_from)
        finally:
            decoder.features = None
        for row in trees:
            for index, slot in enumerate(result[row][2]):
                self.own_by_slot[slot] = decoder.own[row, index]
        return result

    def hold(self, row: int, slots: list[int]) -> None:
        """Nothing is held: a tree's accepted nodes were read with own states (the class docstring)."""

    def crop_row(self, row: int, length: int) -> None:
        if length == 0:
            self.started[row], self.from_target[row], self.own[row] = False, 0, None
            super().crop_row(row, 0)
            return
        super().crop_row(row, min(length - 1, self.from_target[row]))
        self.from_target[row] = min(self.from_target[row], len(self.slots[row]))


def tree_caches(engine_target: Any, engine_draft: Any, rows: int) -> tuple[BatchCache, Any]:
    """(the shared target cache of a tree decode, a maker of each request's own draft cache: (target row, state layer)
    -> cache), plain or an EAGLE-3 drafter's."""
    if isinstance(engine_draft, Eagle3Model):
        target = StreamBatchCache(engine_target, rows, engine_draft.layer_ids)
        return target, lambda row, state_layer: Eagle3BatchCache(engine_draft, 1, target, state_layer, target_row=row)
    return BatchCache(engine_target, rows), lambda row, state_layer: BatchCache(engine_draft, 1, state_layer)


def round_caches(target: Any, draft: Any, rows: int, state_layer: int | None) -> tuple[BatchCache, BatchCache]:
    """(the draft's cache, the target's) for a round engine: plain `BatchCache`s, or an EAGLE-3 drafter's pair."""
    if isinstance(draft, Eagle3Model):
        target_cache = StreamBatchCache(target, rows, draft.layer_ids)
        return Eagle3BatchCache(draft, rows, target_cache, state_layer), target_cache
    return BatchCache(draft, rows, state_layer), BatchCache(target, rows)


def refuse_for_eagle3(rule: Any, prompt_cache: Any, companion: Any) -> None:
    """What the round engine cannot do yet with an EAGLE-3 draft, refused in one line before any forward."""
    if not rule.bonus:
        raise UsageError(f"the {rule.name} rule earns no bonus token, which an EAGLE-3 draft's first round needs; use a "
                         "stop rule (constant_k, confidence, svip, head)")
    if prompt_cache is not None or companion is not None:
        raise UsageError("an EAGLE-3 draft runs without a prompt cache or SV's companion for now; build the engine "
                         "without them")
