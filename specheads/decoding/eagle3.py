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
from typing import Any

import torch
from transformers import DynamicCache

from specheads.decoding.cache import BatchCache
from specheads.decoding.features import (
    DrafterResult,
    FeatureDraft,
    FeatureTarget,
    StreamBatchCache,
    additive_mask,
    chain_decode,
    place_logits,
)
from specheads.decoding.sampler import draw
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.drafters import draft_rows
from specheads.pair.eagle3 import drafter_forward


class Eagle3Draft:
    """A drafter with its own KV cache for one request: `feed` reads tokens with the target's fused features or the
    drafter's own states, `crop` forgets entries, `log_q` gives q over the target's vocabulary."""

    def __init__(self, drafter: Any, target_vocabulary: int) -> None:
        self.drafter = drafter
        self.rows = draft_rows(drafter)
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
        start, count = self.first_position + self.length, len(tokens)
        ids = torch.tensor([tokens], device=features.device)
        rows = drafter.fc(features.unsqueeze(0)) if fused else features.unsqueeze(0)
        positions = torch.arange(start, start + count, device=features.device).unsqueeze(0)
        held = self.length
        mask = torch.full((count, held + count), -math.inf, dtype=rows.dtype, device=rows.device)
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
        return transform.log_probs(place_logits(logits, self.rows, self.vocabulary))

    def propose(self, verifier: FeatureTarget, tokens: list[int], drafting: int, transform: SamplingTransform,
                generator: torch.Generator) -> tuple[list[int], list[torch.Tensor], list[float]]:
        """`drafting` candidates after `tokens`, whose last the target has not read (`chain_decode`'s proposer): a
        catch-up with the target's features, then each candidate drawn from q and read back with the drafter's own
        state, one forward each but the last; those own-state entries are dropped after (module docstring)."""
        standing = len(tokens)
        candidates: list[int] = []
        log_qs: list[torch.Tensor] = []
        catch_up = tokens[self.first_position + self.length:]
        logits, own = self.feed(catch_up, verifier.features[self.length:standing - 1], fused=True)
        for k in range(drafting):
            log_q = self.log_q(logits[-1], transform)
            candidates.append(draw(log_q, generator))
            log_qs.append(log_q)
            if k + 1 < drafting:
                logits, own = self.feed(candidates[-1:], own[-1:], fused=False)
        self.crop(standing - self.first_position)
        return candidates, log_qs, []


def eagle3_decode(target: Any, drafter: Any, prompt: list[int], transform: SamplingTransform, max_draft: int,
                  max_new_tokens: int, seed: int, stop_ids: list[int] | tuple[int, ...] = ()) -> DrafterResult:
    """Decode one request with `drafter` drafting `max_draft` candidates a round (see the module docstring)."""
    draft = Eagle3Draft(drafter, target.config.vocab_size)
    return chain_decode(target, drafter.config.eagle_aux_hidden_state_layer_ids, draft, prompt, transform, max_draft,
                        max_new_tokens, seed, stop_ids)


# ---- the same draft behind the round engine's caches (`specheads.decoding.engine.RoundEngine`, B rows)


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
        dtype = drafter.embed_tokens.weight.dtype
        # no features set: a plain `BatchCache` timing the drafter's forward (`specheads profile`): every token read as
        # a catch-up's are, its target streams (zeros cost the same) through the fusion layer `fc`
        features = (drafter.fc(torch.zeros(*input_ids.shape, drafter.fc.in_features, dtype=dtype, device=input_ids.device))
                    if self.features is None else self.features)
        mask = additive_mask(attention_mask, input_ids.shape[1], dtype)
        normed, self.own = drafter_forward(drafter, input_ids, features, mask, position_ids, cache)
        return BaseModelOutputWithPast(last_hidden_state=normed, past_key_values=cache)


class Eagle3Model(FeatureDraft):
    """An EAGLE-3 drafter with the face of a causal LM over the target's vocabulary, as the round engine's draft:
    `RoundEngine(target, Eagle3Model(drafter, target), ...)` decodes with it exactly (`Eagle3BatchCache`)."""

    kind = "an EAGLE-3"

    def __init__(self, drafter: Any, target: Any) -> None:
        super().__init__(drafter, target, drafter.config.eagle_aux_hidden_state_layer_ids, Eagle3Decoder(drafter))

    def draft_cache(self, target: StreamBatchCache, rows: int, state_layer: int | None = None,
                    target_row: int | None = None) -> BatchCache:
        return Eagle3BatchCache(self, rows, target, state_layer, target_row)


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
        if caught_up:  # every row's target streams through `fc` in one forward
            fused = decoder.drafter.fc(torch.cat(list(caught_up.values())).to(self.device))
            features.update(zip(caught_up, fused.split([len(part) for part in caught_up.values()])))
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
