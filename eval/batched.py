"""Batched decoding loops: B prompts at once, each row with its own policy state, accepted length and random stream.

The batch-1 loops of `eval.decoding` are the reference; with the same per-row seeds every row here makes the
same draws in the same order, so its tokens equal the batch-1 loop's up to the last bits of a padded
forward (identical in float64; tests/test_batched.py).

Ragged caches: both models keep one KV cache for the batch and a mask of the slots each row may attend to.
A step feeds each row its own tokens, right-padded with masked slots, at the row's own positions; a row that
rejects candidates masks their slots instead of cropping (the common tail no row needs is cropped). A row
that finishes is masked out of later forwards. Draft forwards run while any row still drafts (rows that
stopped feed a masked pad and are not counted); the target runs once a round over every row's candidates.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from specheads.data_gen.labels import output_logits
from specheads.eval.decoding import Decoder, DecodeResult, candidate_signals
from specheads.eval.policies import Drafted, StopPolicy
from specheads.heads import AcceptanceHead
from specheads.states import decoder_forward


class BatchCache:
    """A causal LM with one KV cache for B rows of different lengths: per-row slots, positions and a slot mask."""

    def __init__(self, model: Any, rows: int, state_layer: int | None = None):
        self.model = model
        self.state_layer = state_layer
        self.device = next(model.parameters()).device
        self.cache: Any = None
        self.mask = torch.zeros(rows, 0, dtype=torch.long, device=self.device)
        self.slots: list[list[int]] = [[] for _ in range(rows)]  # each row's cache slot per token it holds
        self.forwards = [0] * rows  # the forwards each row took part in
        self.passes = 0  # forward passes of the whole batch
        self.forward_seconds = 0.0

    @property
    def lengths(self) -> list[int]:
        """Tokens each row holds (the position of its next token)."""
        return [len(slots) for slots in self.slots]

    def length(self, row: int) -> int:
        """Tokens `row` holds."""
        return len(self.slots[row])

    @torch.no_grad()
    def feed(self, tokens: dict[int, list[int]], logits_rows: dict[int, int] | None = None
             ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Extend the rows in `tokens` by their tokens (other rows feed a masked pad); per fed row, the float32 logits
        and `state_layer` states of its last `logits_rows[row]` (default 1) tokens."""
        start = time.perf_counter()
        rows, width = len(self.slots), max(len(t) for t in tokens.values())
        used = self.mask.shape[1]
        input_ids = torch.zeros(rows, width, dtype=torch.long)
        new_mask = torch.zeros(rows, width, dtype=torch.long)
        positions = torch.zeros(rows, width, dtype=torch.long)
        for row, fed in tokens.items():
            length = self.length(row)
            input_ids[row, : len(fed)] = torch.tensor(fed)
            new_mask[row, : len(fed)] = 1
            positions[row] = torch.arange(length, length + width).clamp_max(length + len(fed) - 1)
            self.slots[row].extend(range(used, used + len(fed)))
            self.forwards[row] += 1
        self.mask = torch.cat([self.mask, new_mask.to(self.device)], dim=1)
        output, states = decoder_forward(self.model, self.state_layer, input_ids=input_ids.to(self.device),
                                         attention_mask=self.mask, position_ids=positions.to(self.device),
                                         past_key_values=self.cache, use_cache=True)
        self.cache = output.past_key_values
        wanted = {row: (logits_rows or {}).get(row, 1) for row in tokens}
        index = [(row, position) for row, fed in tokens.items() for position in range(len(fed) - wanted[row], len(fed))]
        row_index = torch.tensor([r for r, _ in index], device=self.device)
        column_index = torch.tensor([c for _, c in index], device=self.device)
        logits = output_logits(self.model, output.last_hidden_state[row_index, column_index])
        picked = states[row_index, column_index]
        result, offset = {}, 0
        for row in tokens:
            result[row] = (logits[offset : offset + wanted[row]], picked[offset : offset + wanted[row]])
            offset += wanted[row]
        self.passes += 1
        self.forward_seconds += time.perf_counter() - start
        return result

    def crop_row(self, row: int, length: int) -> None:
        """Forget `row`'s tokens beyond `length`: their slots are masked for every later query."""
        dropped = self.slots[row][length:]
        if dropped:
            self.mask[row, dropped] = 0
            del self.slots[row][length:]

    def trim(self) -> None:
        """Crop the cache's tail of slots no row attends to any more."""
        needed = max((slots[-1] + 1 for slots in self.slots if slots), default=0)
        extra = self.mask.shape[1] - needed
        if extra > 0 and self.cache is not None:
            self.cache.crop(-extra)
            self.mask = self.mask[:, :needed]


@torch.no_grad()
def acceptance_batch(head: AcceptanceHead, states: list[torch.Tensor], signals: list[dict[str, float]],
                     embeddings: list[torch.Tensor | None], positions: list[int]) -> list[float]:
    """The head's acceptance probabilities for several rows' candidates in one call (as `acceptance_step` per row)."""
    columns = [[row[name] for name in head.extra_features] for row in signals]
    signal_tensor = (torch.tensor(columns, dtype=torch.float32, device=states[0].device)
                     if head.extra_features else None)
    embedding = torch.cat(embeddings) if embeddings and embeddings[0] is not None else None
    position = torch.tensor(positions, device=states[0].device)
    return head.predict(torch.stack(states), signal_tensor, embedding, position).tolist()


class Drawn(NamedTuple):
    """A row's candidate of this draft step: the token, its draft signals, the draft's log q and the state that
    produced q (the one an `at_draft` head reads, or the one that has read the previous candidate)."""

    token: int
    signals: dict[str, float]
    logq_all: torch.Tensor
    state: torch.Tensor


class BatchDecoder(Decoder):
    """`Decoder` over B prompts at once; every row draws from its own generator exactly as the batch-1 loop does."""

    def _draw_rows(self, outputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
                   generators: list[torch.Generator]) -> dict[int, Drawn]:
        """Each fed row's candidate from its last draft logits, drawn with the row's own generator."""
        drawn = {}
        for row, (logits, states) in outputs.items():
            logq_all = self.transform.log_probs(logits[-1])
            token = self._draw(logq_all, generators[row])
            drawn[row] = Drawn(token, candidate_signals(logits[-1], logq_all, token, self.transform), logq_all, states[-1])
        return drawn

    @torch.no_grad()
    def speculative_decode_batch(self, prompts: list[list[int]], policy: StopPolicy, max_new_tokens: int,
                                 seeds: list[int], head: AcceptanceHead | None = None) -> list[DecodeResult]:
        """Exact speculative sampling of each prompt under `policy` (row i seeded with `seeds[i]`)."""
        if policy.reads_head and head is None:
            raise ValueError(f"the {policy.name} policy needs an acceptance head")
        start = time.perf_counter()
        rows = range(len(prompts))
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        draft = BatchCache(self.draft, len(prompts), head.state_layer if head is not None else None)
        target = BatchCache(self.target, len(prompts))
        on_time = policy.reads_head and head.decides == "at_draft"
        tokens = [list(prompt) for prompt in prompts]
        generated: list[list[int]] = [[] for _ in rows]
        results = [DecodeResult(tokens=[]) for _ in rows]
        active = [not self._done(generated[row], max_new_tokens) for row in rows]
        while any(active):
            live = [row for row in rows if active[row]]
            caps = {row: min(policy.max_draft, max_new_tokens - len(generated[row])) for row in live}
            candidates: dict[int, list[int]] = {row: [] for row in live}
            logq_rows: dict[int, list[torch.Tensor]] = {row: [] for row in live}
            acceptance = dict.fromkeys(live, 1.0)
            previous: dict[int, dict[str, float] | None] = dict.fromkeys(live)
            pending = {row: tokens[row][draft.length(row):] for row in live}
            while pending:
                drawn = self._draw_rows(draft.feed(pending), generators)
                scores = self._head_scores(head, policy, on_time, drawn, candidates, previous)
                for row, (token, signals, logq_all, _) in drawn.items():
                    acceptance[row] *= scores.get(row, 1.0)
                    candidates[row].append(token)
                    logq_rows[row].append(logq_all)
                    seen = Drafted(index=len(candidates[row]), prob=signals["prob"], entropy=signals["entropy"],
                                   acceptance=acceptance[row])
                    if len(candidates[row]) >= caps[row] or policy.stop(seen):
                        del pending[row]
                    else:
                        pending[row], previous[row] = [token], signals
            verified = target.feed({row: tokens[row][target.length(row):] + candidates[row] for row in live},
                                   {row: len(candidates[row]) + 1 for row in live})
            for row in live:
                accepted, new_token = self._verify(verified[row][0], candidates[row], logq_rows[row], generators[row])
                accepted, emitted = self._standing(candidates[row], accepted, new_token,
                                                   max_new_tokens - len(generated[row]))
                results[row].target_calls += 1
                self._count_round(results[row], policy, len(candidates[row]), accepted)
                target.crop_row(row, len(tokens[row]) + accepted)
                draft.crop_row(row, len(tokens[row]) + accepted)
                tokens[row] += emitted
                generated[row] += emitted
                active[row] = not self._done(generated[row], max_new_tokens)
            draft.trim()
            target.trim()
        return self._finish_batch(results, generated, start, draft, target)

    def _head_scores(self, head: AcceptanceHead | None, policy: StopPolicy, on_time: bool, drawn: dict[int, Drawn],
                     candidates: dict[int, list[int]], previous: dict[int, dict[str, float] | None]) -> dict[int, float]:
        """The head's score per drafting row at this step: of the candidate just drafted (an `at_draft` head), or of
        the previous one, whose state this forward gave (a `one_step_late` head); none for other policies."""
        if not policy.reads_head:
            return {}
        if on_time:
            rows = list(drawn)
            inputs = [(drawn[r].state, drawn[r].signals, drawn[r].token, len(candidates[r]) + 1) for r in rows]
        else:
            rows = [r for r in drawn if previous[r] is not None]
            inputs = [(drawn[r].state, previous[r], candidates[r][-1], len(candidates[r])) for r in rows]
        if not rows:
            return {}
        states, signals, tokens, positions = zip(*inputs)
        scores = acceptance_batch(head, list(states), list(signals), [self._embedding(head, t) for t in tokens],
                                  list(positions))
        return dict(zip(rows, scores))

    @torch.no_grad()
    def sprinter_decode_batch(self, prompts: list[list[int]], verifier: AcceptanceHead, threshold: float,
                              max_new_tokens: int, seeds: list[int]) -> list[DecodeResult]:
        """SPRINTER over B prompts at once: the target runs only for rows whose drafted token scored below
        `threshold` (as `Decoder.sprinter_decode` row by row)."""
        start = time.perf_counter()
        rows = range(len(prompts))
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        draft, target = BatchCache(self.draft, len(prompts), verifier.state_layer), BatchCache(self.target, len(prompts))
        tokens = [list(prompt) for prompt in prompts]
        generated: list[list[int]] = [[] for _ in rows]
        results = [DecodeResult(tokens=[]) for _ in rows]
        runs = [0] * len(prompts)
        active = [not self._done(generated[row], max_new_tokens) for row in rows]
        while any(active):
            drawn = self._draw_rows(draft.feed({row: tokens[row][draft.length(row):] for row in rows if active[row]}),
                                    generators)
            order = list(drawn)
            scores = acceptance_batch(verifier, [drawn[r].state for r in order], [drawn[r].signals for r in order],
                                      [self._embedding(verifier, drawn[r].token) for r in order], [1] * len(order))
            flagged = [row for row, score in zip(order, scores) if score < threshold]
            verified = target.feed({row: tokens[row][target.length(row):] for row in flagged}) if flagged else {}
            for row in order:
                token, _, logq_all, _ = drawn[row]
                results[row].drafted += 1
                emitted = token
                if row in verified:
                    results[row].target_calls += 1
                    logp_all = self.transform.log_probs(verified[row][0][-1])
                    if self._accepts(float(logp_all[token]), float(logq_all[token]), generators[row]):
                        results[row].accepted += 1
                        runs[row] += 1
                    else:
                        emitted = self._residual_draw(logp_all, logq_all, generators[row])
                    results[row].accepted_per_round.append(runs[row])
                    runs[row] = 0
                else:
                    results[row].accepted += 1
                    runs[row] += 1
                tokens[row].append(emitted)
                generated[row].append(emitted)
                active[row] = not self._done(generated[row], max_new_tokens)
        return self._finish_batch(results, generated, start, draft, target)

    def _finish_batch(self, results: list[DecodeResult], generated: list[list[int]], start: float, draft: BatchCache,
                      target: BatchCache) -> list[DecodeResult]:
        """Each row's output and counts; the batch's wall and forward time are shared equally by its rows."""
        share = 1.0 / len(results)
        wall = time.perf_counter() - start
        for row, result in enumerate(results):
            result.emitted, result.tokens = len(generated[row]), list(generated[row])
            result.draft_forwards = draft.forwards[row]
            result.seconds = wall * share
            result.time_forwards(draft, target, share)
        return results
