"""Reference decoding loops with KV caches for both models, batch size 1 (docs/method.md "Decision timing at inference").

`speculative_decode` is exact speculative sampling under a stop policy: the draft proposes candidates
until the policy stops, the target scores them all in one forward, each is accepted with probability
min(1, p/q), the first rejected one is replaced by a draw from norm(max(0, p − q)), and a fully accepted
round earns a bonus token from p. Caches are cropped to the accepted prefix, never recomputed.

`sprinter_decode` is SPRINTER's approximate loop: the verifier scores each drafted token from the state
before it; only a flagged token is sent to the target (which catches up on the unverified tokens in
the same forward) and goes through the p/q test; unflagged tokens stand unverified.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specheads.data_gen.labels import output_logits, signal_log_probs, signal_statistics
from specheads.eval.policies import Drafted, StopPolicy
from specheads.heads import AcceptanceHead, with_derived_signals
from specheads.sampling import SamplingTransform, draw_from_log_probs, uniforms
from specheads.states import decoder_forward


class CachedModel:
    """A causal LM with its own KV cache over the tokens fed so far; times its forwards."""

    def __init__(self, model: Any, state_layer: int | None = None):
        self.model = model
        self.state_layer = state_layer
        self.device = next(model.parameters()).device
        self.cache: Any = None
        self.length = 0
        self.forwards = 0
        self.forward_seconds = 0.0

    @torch.no_grad()
    def feed(self, tokens: list[int], logits_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the cache by `tokens`; returns (float32 logits of the last `logits_rows` positions, their states at
        `state_layer`, the ones a head reads)."""
        start = time.perf_counter()
        output, states = decoder_forward(self.model, self.state_layer, input_ids=torch.tensor([tokens], device=self.device),
                                         past_key_values=self.cache, use_cache=True)
        self.cache = output.past_key_values
        logits = output_logits(self.model, output.last_hidden_state[0, -logits_rows:])
        states = states[0, -logits_rows:]
        self.length += len(tokens)
        self.forwards += 1
        self.forward_seconds += time.perf_counter() - start
        return logits, states

    @property
    def passes(self) -> int:
        """Forward passes so far (with one row, every forward is one pass)."""
        return self.forwards

    def crop_to(self, length: int) -> None:
        """Forget cached tokens beyond `length`.

        transformers 5.23's `DynamicCache.crop` takes minus the number of tokens to remove (a positive value,
        the 4.x absolute length, raises).
        """
        if self.length > length:
            self.cache.crop(-(self.length - length))
            self.length = length


@dataclass
class DecodeResult:
    """One decoding run: the generated tokens and the counts the metrics are made of."""

    tokens: list[int]
    emitted: int = 0  # tokens in the output, ended at max_new_tokens or the first stop token (the rates' numerator)
    drafted: int = 0  # candidates proposed (the oracle counts only those it keeps)
    accepted: int = 0  # candidates that stand in the output
    target_calls: int = 0
    draft_forwards: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)  # candidates each round sent to the target
    seconds: float = 0.0
    forward_seconds: float = 0.0
    draft_seconds: float = 0.0  # time in the draft's forwards (a batched run's share of its batch's)
    target_seconds: float = 0.0
    draft_passes: float = 0.0  # the draft's forward passes (a batched run's share of its batch's)
    target_passes: float = 0.0

    def time_forwards(self, draft: Any, target: Any, share: float = 1.0) -> None:
        """Record `share` of each model's timed forwards (`forward_seconds` and `passes` of a cached model)."""
        self.draft_seconds, self.draft_passes = draft.forward_seconds * share, draft.passes * share
        self.target_seconds, self.target_passes = target.forward_seconds * share, target.passes * share
        self.forward_seconds = self.draft_seconds + self.target_seconds


@torch.no_grad()
def acceptance_step(head: AcceptanceHead, state: torch.Tensor, signals: dict[str, float],
                    embedding: torch.Tensor | None, position: int | None = None) -> float:
    """The head's acceptance probability for one candidate from its state and draft signals; `position` (1-based in
    the round) applies a stop head's per-position calibration."""
    columns = [signals[name] for name in head.extra_features]
    signal_tensor = torch.tensor([columns], dtype=torch.float32, device=state.device) if columns else None
    return float(head.predict(state.unsqueeze(0), signal_tensor, embedding, position)[0])


def candidate_signals(draft_logits: torch.Tensor, logq_all: torch.Tensor, token: int,
                      transform: SamplingTransform) -> dict[str, float]:
    """The draft's signals for a candidate, as data_gen stored them (logq, entropy, top1, and the derived q), and
    `prob`, the candidate's probability under the signal transform, for the confidence policy."""
    logq_signal = signal_log_probs(draft_logits, logq_all, transform)
    entropy, top1 = signal_statistics(logq_signal)
    return with_derived_signals({"logq": float(logq_all[token]), "entropy": float(entropy), "top1": float(top1),
                                 "prob": math.exp(float(logq_signal[token]))})


class Decoder:
    """A draft/target pair and the sampling transform, ready to decode prompts under different policies."""

    def __init__(self, target: Any, draft: Any, transform: SamplingTransform, stop_ids: list[int]):
        self.target, self.draft, self.transform, self.stop_ids = target, draft, transform, set(stop_ids)

    def _embedding(self, head: AcceptanceHead | None, token: int) -> torch.Tensor | None:
        if head is None or not head.candidate_embedding_size:
            return None
        table = self.draft.get_input_embeddings()
        return table(torch.tensor([token], device=table.weight.device)).float()

    def _draw(self, log_probs: torch.Tensor, generator: torch.Generator) -> int:
        return int(draw_from_log_probs(log_probs.unsqueeze(0), uniforms(generator, 1))[0])

    def _accepts(self, logp: float, logq: float, generator: torch.Generator) -> bool:
        return float(uniforms(generator, 1)[0]) <= min(1.0, math.exp(logp - logq))

    def _residual_draw(self, logp_all: torch.Tensor, logq_all: torch.Tensor, generator: torch.Generator) -> int:
        residual = (logp_all.exp() - logq_all.exp()).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: a rejection has probability 0, keep the draw valid anyway
            residual = logp_all.exp()
        return self._draw(residual.log(), generator)

    def _verify(self, logits: torch.Tensor, candidates: list[int], logq_rows: list[torch.Tensor],
                generator: torch.Generator) -> tuple[int, int]:
        """Exact verification of a round from the target's logits at the candidates' positions (and one more):
        (accepted candidates, the token that follows them: a residual draw at the first rejection, else a bonus)."""
        for index, token in enumerate(candidates):
            logp_all = self.transform.log_probs(logits[index])
            if not self._accepts(float(logp_all[token]), float(logq_rows[index][token]), generator):
                return index, self._residual_draw(logp_all, logq_rows[index], generator)
        return len(candidates), self._draw(self.transform.log_probs(logits[len(candidates)]), generator)

    @staticmethod
    def _count_round(result: DecodeResult, policy: StopPolicy, drafted: int, accepted: int) -> None:
        counted = accepted if policy.hindsight else drafted
        result.drafted += counted
        result.accepted += accepted
        result.accepted_per_round.append(accepted)
        result.drafted_per_round.append(counted)

    def _standing(self, candidates: list[int], accepted: int, new_token: int, room: int) -> tuple[int, list[int]]:
        """What a verified round adds to the output: its accepted candidates and the target's token, ended at the first
        stop token (the run ends there) and at `room` tokens (max_new_tokens); and how many accepted candidates stand."""
        emitted = (candidates[:accepted] + [new_token])[:room]
        for position, token in enumerate(emitted):
            if token in self.stop_ids:
                emitted = emitted[: position + 1]
                break
        return min(accepted, len(emitted)), emitted

    def _finish(self, result: DecodeResult, generated: list[int], start: float, draft: CachedModel,
                target: CachedModel) -> DecodeResult:
        result.emitted, result.tokens = len(generated), list(generated)
        result.seconds = time.perf_counter() - start
        result.time_forwards(draft, target)
        return result

    def _done(self, generated: list[int], max_new_tokens: int) -> bool:
        return len(generated) >= max_new_tokens or any(token in self.stop_ids for token in generated)

    @torch.no_grad()
    def speculative_decode(self, prompt: list[int], policy: StopPolicy, max_new_tokens: int, seed: int,
                           head: AcceptanceHead | None = None) -> DecodeResult:
        """Exact speculative sampling of up to `max_new_tokens` tokens after `prompt` under `policy`."""
        if policy.reads_head and head is None:
            raise ValueError(f"the {policy.name} policy needs an acceptance head")
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        draft, target = CachedModel(self.draft, head.state_layer if head is not None else None), CachedModel(self.target)
        on_time = policy.reads_head and head.decides == "at_draft"
        tokens, generated = list(prompt), []
        result = DecodeResult(tokens=[])
        while not self._done(generated, max_new_tokens):
            cap = min(policy.max_draft, max_new_tokens - len(generated))
            candidates, logq_rows, acceptance = [], [], 1.0
            pending = tokens[draft.length:]
            previous_signals: dict[str, float] | None = None
            while True:
                logits, states = draft.feed(pending, 1)
                logq_all = self.transform.log_probs(logits[-1])
                token = self._draw(logq_all, generator)
                signals = candidate_signals(logits[-1], logq_all, token, self.transform)
                if on_time:  # states[-1] produced q for this candidate: it is scored the moment it is drafted
                    acceptance *= acceptance_step(head, states[-1], signals, self._embedding(head, token),
                                                  len(candidates) + 1)
                elif policy.reads_head and previous_signals is not None:  # states[-1] has read the previous candidate
                    acceptance *= acceptance_step(head, states[-1], previous_signals,
                                                  self._embedding(head, candidates[-1]), len(candidates))
                candidates.append(token)
                logq_rows.append(logq_all)
                drafted = Drafted(index=len(candidates), prob=signals["prob"], entropy=signals["entropy"],
                                  acceptance=acceptance)
                if len(candidates) >= cap or policy.stop(drafted):
                    break
                pending, previous_signals = [token], signals
            logits, _ = target.feed(tokens[target.length:] + candidates, len(candidates) + 1)
            result.target_calls += 1
            accepted, new_token = self._verify(logits, candidates, logq_rows, generator)
            accepted, emitted = self._standing(candidates, accepted, new_token, max_new_tokens - len(generated))
            self._count_round(result, policy, len(candidates), accepted)
            target.crop_to(len(tokens) + accepted)
            draft.crop_to(len(tokens) + accepted)
            tokens += emitted
            generated += emitted
        result.draft_forwards = draft.forwards
        return self._finish(result, generated, start, draft, target)

    @torch.no_grad()
    def sprinter_decode(self, prompt: list[int], verifier: AcceptanceHead, threshold: float, max_new_tokens: int,
                        seed: int) -> DecodeResult:
        """SPRINTER: call the target only for drafted tokens the verifier scores below `threshold`."""
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        draft, target = CachedModel(self.draft, verifier.state_layer), CachedModel(self.target)
        tokens, generated = list(prompt), []
        result = DecodeResult(tokens=[])
        run_length = 0
        while not self._done(generated, max_new_tokens):
            logits, states = draft.feed(tokens[draft.length:], 1)
            logq_all = self.transform.log_probs(logits[-1])
            token = self._draw(logq_all, generator)
            signals = candidate_signals(logits[-1], logq_all, token, self.transform)
            result.drafted += 1
            if acceptance_step(verifier, states[-1], signals, self._embedding(verifier, token)) >= threshold:
                result.accepted += 1
                run_length += 1
                emitted = token
            else:
                target_logits, _ = target.feed(tokens[target.length:], 1)
                result.target_calls += 1
                logp_all = self.transform.log_probs(target_logits[-1])
                if self._accepts(float(logp_all[token]), float(logq_all[token]), generator):
                    result.accepted += 1
                    emitted = token
                    run_length += 1
                else:
                    emitted = self._residual_draw(logp_all, logq_all, generator)
                result.accepted_per_round.append(run_length)
                run_length = 0
            tokens.append(emitted)
            generated.append(emitted)
        result.draft_forwards = draft.forwards
        return self._finish(result, generated, start, draft, target)


@torch.no_grad()
def target_log_likelihoods(target: Any, prompts: list[list[int]], generated: list[list[int]]) -> list[float]:
    """Per run, the mean log-probability the target's own (untransformed) distribution gives its generated tokens
    (NaN for a run that generated none); the runs share one right-padded forward."""
    device = next(target.parameters()).device
    rows = [list(prompt) + list(tokens) for prompt, tokens in zip(prompts, generated)]
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
        mask[index, : len(row)] = 1
    states = target.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state
    results = []
    for index, (prompt, tokens) in enumerate(zip(prompts, generated)):
        if not tokens:
            results.append(float("nan"))
            continue
        log_probs = output_logits(target, states[index, len(prompt) - 1 : len(prompt) + len(tokens) - 1]).log_softmax(-1)
        results.append(float(log_probs.gather(-1, torch.tensor(tokens, device=device).unsqueeze(-1)).mean()))
    return results
