"""EAGLE-3 drafts, exactly: a chain loop for one request (B = 1) whose draft is an EAGLE-3 drafter
(`specheads.pair.eagle3`), fed as vLLM's EAGLE-3 proposer feeds it.

Positions count the request's tokens from 0. The drafter's entry at position t reads token x_t with a feature of
position t − 1: the target's three fused streams (projected by `fc`) where the target has read position t − 1, else
the drafter's own state at t − 1 (its decoder output, normed where the drafter was trained so). A round, with x_0..x_{n−1}
standing and the target holding positions 0..n − 2:

1. **catch-up**: the drafter reads positions it lacks up to n − 1 with the target's features, one forward; its last
   row is q for x_n;
2. **draft**: K candidates, each drawn from q (over the target's vocabulary: the drafter's logits placed at the d2t
   rows, −inf elsewhere, then the sampling transform, so tokens outside the draft vocabulary have q = 0) and read
   back with the drafter's own state, one forward each but the last;
3. **verify**: one target forward over x_{n−1} and the candidates, the p/q test of each
   (`specheads.decoding.sampler.verify`), the token after; the target's features of the positions that stand are
   kept, and the drafter's entries from its own states are dropped (vLLM recomputes the accepted positions with the
   target's features in the next catch-up).

Each q is computed from the verified prefix, its target features and the candidates drawn before it, so the output
follows the target's distribution (docs/method.md); greedy (T = 0) gives the target's greedy tokens.
The round engine (`specheads.decoding.engine`) does not drive this draft yet.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from specheads.decoding.sampler import draw, verify
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.eagle3 import draft_to_target, streams_captured


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
        start, count = self.first_position + self.length, len(tokens)
        ids = torch.tensor([tokens], device=features.device)
        hidden = drafter.fc(features.unsqueeze(0)) if fused else features.unsqueeze(0)
        hidden = torch.cat([drafter.embed_tokens(ids), hidden.to(drafter.fc.weight.dtype)], dim=-1)
        positions = torch.arange(start, start + count, device=features.device).unsqueeze(0)
        held = self.length
        mask = torch.full((count, held + count), -math.inf, dtype=hidden.dtype, device=hidden.device)
        mask = torch.triu(mask, diagonal=held + 1)[None, None]  # each token sees what is held and itself
        embeddings = drafter.rotary_emb(hidden, positions)
        for layer in drafter.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, past_key_values=self.cache, use_cache=True,
                           position_embeddings=embeddings)
        normed = drafter.norm(hidden)
        self.forwards += 1
        own = normed if drafter.config.norm_output else hidden
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
        fused = torch.cat([captured[index] for index in self.layer_ids], dim=-1)[0]
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
        catch_up = tokens[draft.first_position + draft.length:]
        features = verifier.features[draft.length:standing - 1]
        logits, own = draft.feed(catch_up, features, fused=True)
        candidates, log_qs = [], []
        for k in range(max_draft):
            log_q = draft.log_q(logits[-1], transform)
            candidates.append(draw(log_q, generator))
            log_qs.append(log_q)
            if k + 1 < max_draft:
                logits, own = draft.feed(candidates[-1:], own[-1:], fused=False)
        p_logits = verifier.feed([tokens[-1], *candidates])
        stood, new = verify(p_logits, candidates, log_qs, 0, True, transform, generator)
        for k in range(max_draft):
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
