"""DSpark drafts, exactly: a DSpark drafter (`specheads.pair.dspark`) drafting a block per forward, in a chain loop for
one request (`dspark_decode`) and behind the round engine's caches (`DSparkModel`: B rows, continuous batching, every
chain rule with a bonus token, and token trees through `decode_tree`).

Positions count the request's tokens from 0. A round, with x_0..x_{n−1} standing and the target holding positions
0..n − 2 (and their streams):

1. **block**: one forward of the drafter. Its context is the target's streams of positions 0..n − 2 (projected by
   `fc`, normed; the round engine's cache keeps their keys and values and reads only the positions it lacks); its block
   is the anchor x_{n−1} and `block_size − 1` mask tokens at positions n − 1.., attending to the context and to the
   whole block. Each slot's state after the final norm and its base logits (the LM head's) are kept for the round.
2. **draft**: candidate k (1-based) is drawn from q_k, the base logits of its slot (k − 1, or k without
   `sample_from_anchor`) plus the Markov head's bias from the token before it (the anchor for k = 1; for an `rnn`
   head, from every token before it in the block), placed at the draft vocabulary's rows of the target's, −inf
   elsewhere, then the sampling transform. Drawing a candidate costs no forward; a round drafts at most the block's
   candidates (`block_candidates`). The confidence head's sigmoid on [the slot's state ; the Markov embedding of the
   token before] is the drafter's own prediction that candidate k is accepted (`drafter_score`): it reads nothing of
   candidate k, so a rule may use it to decide at k before candidate k + 1 is drawn, and a budget may rank by it.
3. **verify**: one target forward over x_{n−1} and the candidates, the p/q test of each with the q it was drawn from
   (`specheads.decoding.sampler.verify`), the token after. The block's keys and values are dropped; the next round's
   block reads the standing positions from the target's streams.

Each q_k is computed from the verified prefix, its target streams and the candidates drawn before it, so the output
follows the target's distribution (docs/method.md); greedy (T = 0) gives the target's greedy tokens. A request's first
round drafts nothing: the drafter needs the target's streams of the prompt. A tree's node gets its children's q the same
way, from its depth's slot and its path's tokens, without a forward; trees are at most a block deep. The prompt cache
and SV's companion do not run with this draft yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast

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
from specheads.decoding.online import drawn_logit
from specheads.decoding.rules import StopPolicy, make_policy
from specheads.decoding.sampler import draw
from specheads.heads.calibration import PositionCalibration, sigmoid
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.drafters import draft_rows
from specheads.pair.dspark import block_candidates
from specheads.plumbing.errors import UsageError


@dataclass
class Block:
    """One row's block of a round: each slot's state after the final norm [B, h] and base logits [B, V_d], and the
    tokens before each candidate drafted so far (the anchor, then the candidates read back)."""

    hidden: torch.Tensor
    base: torch.Tensor
    previous: list[int]


def markov_inputs(config: Any, previous: list[int]) -> list[int]:
    """The previous-token ids of the block's slots up to the one that drafts candidate k = len(`previous`), laid out as
    speculators' training forward lays them: slot s reads the token at anchor + s with `sample_from_anchor`, the one
    before it without (slot 0, unused there, reads the anchor)."""
    return list(previous) if config.sample_from_anchor else [previous[0], *previous]


@torch.no_grad()
def candidate_logits(drafter: Any, block: Block, previous: list[int]) -> tuple[torch.Tensor, float | None]:
    """(the logits over the draft vocabulary, float32, of the candidate after `previous`, the anchor and the
    candidates before it: its slot's base logits plus the Markov head's bias; the confidence head's prediction that it
    is accepted, None without one)."""
    ids = torch.tensor(markov_inputs(drafter.config, previous), device=block.hidden.device)
    slot = len(ids) - 1
    if slot >= block.base.shape[0]:
        raise RuntimeError(f"candidate {len(previous)} lies beyond the drafter's block of {block.base.shape[0]} slots")
    logits = block.base[slot]
    markov = drafter.markov_head
    if markov is not None:
        first = 0 if markov.head_type == "rnn" else slot  # a recurrent head reads every token before; the others one
        bias = markov.block_bias(prev_token_ids=ids[None, first:], hidden_states=block.hidden[None, first: slot + 1])
        logits = logits + bias[0, -1]
    confidence = None
    if drafter.confidence_head is not None:
        features = block.hidden[slot]
        if drafter.config.confidence_head_with_markov:
            features = torch.cat([features, markov.prev_embeddings(ids[slot]).to(features.dtype)])
        confidence = float(torch.sigmoid(drafter.confidence_head(features).float()))
    return logits.float(), confidence


@torch.no_grad()
def block_forward(drafter: Any, features: torch.Tensor, anchor: int) -> Block:
    """The block after the context whose target streams are `features` [n, k·h] (positions 0..n − 1), its anchor
    `anchor` at position n: one forward over the whole context, no cache (the reference the round engine's cached
    forward is tested against)."""
    dtype = drafter.fc.weight.dtype
    context = drafter.hidden_norm(drafter.fc(features.to(dtype)))[None]
    size, at = drafter.config.block_size, features.shape[0]
    ids = torch.full((1, size), drafter.config.mask_token_id, device=features.device)
    ids[0, 0] = anchor
    hidden = drafter.embed_tokens(ids)
    positions = torch.arange(at + size, device=features.device)[None]  # the context's, then the block's
    embeddings = drafter.rotary_emb(hidden, positions)
    for layer in drafter.layers:
        hidden = layer(hidden_states=hidden, target_hidden=context, attention_mask=None, position_ids=positions,
                       use_cache=False, position_embeddings=embeddings)
    hidden = drafter.norm(hidden)[0]
    return Block(hidden, drafter.lm_head(hidden), [anchor])


class DSparkDraft:
    """A DSpark drafter for one request (`chain_decode`'s proposer): a block per round, recomputed from the target's
    streams."""

    def __init__(self, drafter: Any, target_vocabulary: int) -> None:
        self.drafter, self.vocabulary = drafter, target_vocabulary
        self.rows = draft_rows(drafter)
        self.forwards = 0

    def propose(self, verifier: FeatureTarget, tokens: list[int], drafting: int, transform: SamplingTransform,
                generator: torch.Generator) -> tuple[list[int], list[torch.Tensor], list[float]]:
        """`drafting` candidates after `tokens` from one block (module docstring), with the confidence head's
        prediction for each (none without a head)."""
        block = block_forward(self.drafter, verifier.features[: len(tokens) - 1], tokens[-1])
        self.forwards += 1
        candidates: list[int] = []
        log_qs: list[torch.Tensor] = []
        scores: list[float] = []
        for _ in range(drafting):
            logits, confidence = candidate_logits(self.drafter, block, [tokens[-1], *candidates])
            log_q = transform.log_probs(place_logits(logits, self.rows, self.vocabulary))
            candidates.append(draw(log_q, generator))
            log_qs.append(log_q)
            if confidence is not None:
                scores.append(confidence)
        return candidates, log_qs, scores


def dspark_decode(target: Any, drafter: Any, prompt: list[int], transform: SamplingTransform, max_draft: int,
                  max_new_tokens: int, seed: int, stop_ids: list[int] | tuple[int, ...] = ()) -> DrafterResult:
    """Decode one request with `drafter` drafting up to `max_draft` candidates a round, at most its block's (see the
    module docstring); `confidence` holds the confidence head's prediction per drafted position of each round."""
    draft = DSparkDraft(drafter, target.config.vocab_size)
    return chain_decode(target, drafter.config.aux_hidden_state_layer_ids, draft, prompt, transform,
                        min(max_draft, block_candidates(drafter.config)), max_new_tokens, seed, stop_ids)


# ---- the same draft behind the round engine's caches (`specheads.decoding.engine.RoundEngine`, B rows)


class DSparkDecoder(torch.nn.Module):
    """The drafter's layers as a decoder: queries are the tokens fed, keys and values those of the cache, of the
    `context` set before the forward (the target's streams, projected and normed, at the first positions of
    `position_ids`) and of the tokens fed. Without a context it is the forward `specheads profile` times on a plain
    `BatchCache`: every token fed a block slot."""

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        self.drafter = drafter
        self.layers = drafter.layers
        self.context: torch.Tensor | None = None  # [B, C, h]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                use_cache: bool = True, past_key_values: Any = None) -> Any:
        drafter, cache = self.drafter, past_key_values if past_key_values is not None else DynamicCache()
        hidden = drafter.embed_tokens(input_ids)
        context = hidden[:, :0] if self.context is None else self.context.to(hidden.dtype)
        mask = additive_mask(attention_mask, context.shape[1] + input_ids.shape[1], hidden.dtype)
        embeddings = drafter.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden_states=hidden, target_hidden=context, attention_mask=mask, position_ids=position_ids,
                           past_key_value=cache, use_cache=True, position_embeddings=embeddings)
        return BaseModelOutputWithPast(last_hidden_state=drafter.norm(hidden), past_key_values=cache)


class DSparkModel(FeatureDraft):
    """A DSpark drafter with the face of a causal LM over the target's vocabulary, as the round engine's draft:
    `RoundEngine(target, DSparkModel(drafter, target), ...)` decodes with it exactly (`DSparkBatchCache`)."""

    kind = "a DSpark"

    def __init__(self, drafter: Any, target: Any) -> None:
        super().__init__(drafter, target, drafter.config.aux_hidden_state_layer_ids, DSparkDecoder(drafter))
        self.candidates = block_candidates(drafter.config)
        self.block = drafter.config.block_size
        self.scores = drafter.confidence_head is not None
        self.score_temperatures: PositionCalibration | None = None  # per candidate k, its confidence's temperature
        # (scale 1/T_k, bias 0 as SGLang's table applies it; `drafter_score_scaled`), set by who fitted them
        markov = drafter.markov_head
        self.markov_rank = int(markov.markov_rank) if markov is not None else 0  # what a head of our own may read

    def own_rule(self) -> StopPolicy:
        """Its whole block each round (constant K at the block's candidates), as vLLM serves a DSpark drafter."""
        return make_policy("constant_k", self.candidates, max_draft=self.candidates)

    def draft_cache(self, target: StreamBatchCache, rows: int, state_layer: int | None = None,
                    target_row: int | None = None) -> BatchCache:
        if state_layer is not None:
            raise UsageError(f"a head reading the draft's layer {state_layer} cannot read a DSpark drafter, whose state "
                             "is its block slot's after the final norm; use a head trained on that state")
        return DSparkBatchCache(self, rows, target, target_row)


class DSparkBatchCache(BatchCache):
    """The drafter's `BatchCache`: per row, the keys and values of the context positions it has read (slots, as a
    plain `BatchCache` holds tokens) and the round's `Block`. Feeding a row that has no block is a catch-up: its last
    token is the anchor, the others context positions whose streams the target holds; one forward reads them all and
    the block (`block_forward`'s, batched and cached). Feeding a row that has a block one drafted token gives the next
    candidate's logits without a forward. `crop_row` (the chain's round end) and `hold` (a tree's) drop the block."""

    def __init__(self, model: DSparkModel, rows: int, target: StreamBatchCache, target_row: int | None = None) -> None:
        super().__init__(model, rows)
        self.target = target
        self.target_row = target_row  # a tree request's own cache (one row) reads this row of the shared target's
        self.blocks: list[Block | None] = [None] * rows
        self.scores: list[float | None] = [None] * rows
        self.nodes: dict[int, int] = {}  # a tree's nodes read from the block: their token by the id they were given

    def length(self, row: int) -> int:
        """Positions the row has read: its context's, then the block's anchor and the candidates read back."""
        block = self.blocks[row]
        return len(self.slots[row]) + (len(block.previous) if block is not None else 0)

    def of_target(self, row: int) -> int:
        """The target's row that `row` drafts for."""
        return row if self.target_row is None else self.target_row

    def can_draft(self, row: int) -> bool:
        """Only once the target has read the row's prompt: the block's context is the target's streams."""
        return self.target.length(self.of_target(row)) > 0

    def draft_limit(self) -> int:
        return self.model.candidates

    def drafter_score(self, row: int) -> float | None:
        return self.scores[row]

    def drafter_score_scaled(self, row: int) -> float | None:
        """The confidence of the row's last candidate (candidate k = len(block.previous)) through the model's
        `score_temperatures`: σ(z / T_k), z its logit; None without them."""
        calibration, score = self.model.score_temperatures, self.scores[row]
        if calibration is None or score is None:
            return None
        scaled = calibration.logits(np.array([drawn_logit(score)]), np.array([len(self.blocks[row].previous)]))
        return float(sigmoid(scaled)[0])  # the logit the temperatures were fitted on (eval.offline.logits)

    def markov_embedding(self, row: int) -> torch.Tensor | None:
        """The Markov head's embedding of the token before the row's last candidate (`block.previous`'s last)."""
        block, markov = self.blocks[row], self.model.drafter.markov_head
        if block is None or markov is None:
            return None
        return markov.prev_embeddings(torch.tensor(block.previous[-1], device=self.device)).float()

    def round_widths(self, unread: int, drafted: int) -> list[int]:
        """One forward a round: the context positions it had not read (all the unread tokens but the anchor) and the
        block."""
        return [unread - 1 + self.model.block] if drafted else []

    def feed(self, tokens: dict[int, list[int]], logits_rows: dict[int, int] | None = None
             ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per fed row, the logits over the target's vocabulary [1, V] and the slot's state [1, h] of its next
        candidate (the class docstring)."""
        fresh = {row: fed for row, fed in tokens.items() if self.blocks[row] is None}
        for row, fed in tokens.items():
            if row not in fresh:
                if len(fed) != 1:
                    raise RuntimeError("a DSpark block reads one drafted token at a time")
                self.blocks[row].previous.append(fed[0])
        if fresh:
            self.read_blocks(fresh)
        result = {}
        for row in tokens:
            block = self.blocks[row]
            logits, self.scores[row] = candidate_logits(self.model.drafter, block, block.previous)
            slot = len(markov_inputs(self.model.drafter.config, block.previous)) - 1
            result[row] = (place_logits(logits, self.model.head.rows, self.model.head.vocabulary)[None],
                           block.hidden[slot: slot + 1].float())
        return result

    @torch.no_grad()
    def read_blocks(self, fresh: dict[int, list[int]]) -> None:
        """One forward: each row of `fresh` reads the context positions it lacks and its block (anchor: its last
        token); the context's keys and values are kept, the block's dropped."""
        began = time.perf_counter()
        drafter, decoder = self.model.drafter, self.model.get_decoder()
        rows, used, size = len(self.slots), self.mask.shape[1], drafter.config.block_size
        width = max(len(fed) - 1 for fed in fresh.values())
        streams = torch.zeros(rows, width, drafter.fc.in_features, device=self.device)
        ids = torch.full((rows, size), drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        positions = torch.zeros(rows, width + size, dtype=torch.long, device=self.device)
        allowed = torch.zeros(rows, size, used + width + size, dtype=torch.bool, device=self.device)
        allowed[:, :, used + width:] = True  # the whole block, its own row's
        new_mask = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        for row, fed in fresh.items():
            start, count = len(self.slots[row]), len(fed) - 1
            target = self.of_target(row)
            if self.target.length(target) != start + count:
                raise RuntimeError("a DSpark block's anchor must follow every position the target has read")
            streams[row, :count] = self.target.streams[target][start: start + count]
            ids[row, 0] = fed[-1]
            positions[row, :count] = torch.arange(start, start + count)
            positions[row, width:] = torch.arange(start + count, start + count + size)
            allowed[row, :, :used] = self.mask[row].bool()
            allowed[row, :, used: used + count] = True
            new_mask[row, :count] = 1
            self.slots[row].extend(range(used, used + count))
            self.forwards[row] += 1
        dtype = drafter.fc.weight.dtype
        decoder.context = drafter.hidden_norm(drafter.fc(streams.to(dtype)))
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        try:
            output = decoder(input_ids=ids, attention_mask=mask[:, None], position_ids=positions, past_key_values=self.cache)
        finally:
            decoder.context = None
        self.cache = output.past_key_values
        self.cache.crop(-size)  # the block's keys and values: the next round reads a new block
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        hidden = output.last_hidden_state
        base = drafter.lm_head(hidden)
        for row, fed in fresh.items():
            self.blocks[row] = Block(hidden[row], base[row], [fed[-1]])
        self.nodes.clear()
        self.passes += 1
        self.forward_seconds += time.perf_counter() - began

    def feed_trees(self, trees: dict[int, tuple[list[int], list[int], list[list[int]]]],
                   logits_from: dict[int, int] | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]]:
        """A tree's nodes, each giving its children's q from the slot of its depth and its path's tokens (the anchor,
        its ancestors by the ids `sees` names, itself), without a forward; the ids they are given stand for slots."""
        result = {}
        for row, (tokens, _, sees) in trees.items():
            block = self.blocks[row]
            logits, states, ids = [], [], []
            for token, seen in zip(tokens, sees):
                previous = [block.previous[0], *(self.nodes[node] for node in seen), token]
                node_logits, _ = candidate_logits(self.model.drafter, block, previous)
                slot = len(markov_inputs(self.model.drafter.config, previous)) - 1
                logits.append(place_logits(node_logits, self.model.head.rows, self.model.head.vocabulary))
                states.append(block.hidden[slot].float())
                ids.append(-1 - len(self.nodes))
                self.nodes[ids[-1]] = token
            result[row] = (torch.stack(logits), torch.stack(states), ids)
        return result

    def hold(self, row: int, slots: list[int]) -> None:
        """A tree round is over: its nodes were never in the cache, and the block is dropped."""
        self.blocks[row], self.scores[row] = None, None

    def crop_row(self, row: int, length: int) -> None:
        """Drop the round's block, and the context positions beyond `length`."""
        self.blocks[row], self.scores[row] = None, None
        if length < len(self.slots[row]):
            super().crop_row(row, length)
