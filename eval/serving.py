"""Stop policies judged at serving batch sizes: throughput of B concurrent requests (SV's goodput view).

At batch size 1 a drafted token that the target rejects costs only draft time. In a batch the target verifies
every row's candidates in one forward, so its cost grows with the candidates of all rows, and the draft runs
while any row still drafts. The decoding runs record each round's candidates k and accepted tokens a; here
B requests are served together with continuous batching (a finished request's slot takes the next one from
the queue), rounds in lockstep, and each round costs

    Σ_{s=1..max k} c_draft(rows drafting at step s) + c_target(Σ_rows (k + 1))

seconds, with c(n) the forward time against the tokens in the forward (a `CostCurve`, measured on the decoding
device or given). A round yields Σ_rows (a + 1) tokens, but for a request's last round, which yields what its run
emitted after the earlier rounds (a run ends at its first stop token and at max_new_tokens); throughput = tokens /
modelled seconds.

SPRINTER is not served here: its target call checks one flagged token and lets the row's other drafted tokens pass
unverified, with no bonus token, and a row's last round may call no target at all, so its rounds are not the verify
rounds of k + 1 tokens this model prices; the table says so rather than leave it out without a word.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specheads.decoding import BatchCache
from specheads.errors import UsageError

CURVE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
NOT_SERVED = {"sprinter": "SPRINTER's target call checks one flagged token and lets the other drafted tokens pass "
                          "unverified, so its rounds are not the verify rounds of k + 1 tokens this model prices"}


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward against the tokens in it, linear between the points and beyond the last two."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds) or list(self.tokens) != sorted(set(self.tokens)):
            raise UsageError(f"a cost curve needs two or more increasing token counts with one time each, got tokens "
                             f"{list(self.tokens)} and seconds {list(self.seconds)}")
        if min(self.tokens) < 1 or min(self.seconds) <= 0:
            raise UsageError(f"a cost curve's token counts must be >= 1 and its times > 0, got {list(self.tokens)}, "
                             f"{list(self.seconds)}")

    def __call__(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        x, y = np.asarray(self.tokens, float), np.asarray(self.seconds, float)
        if tokens <= x[-1]:
            return float(np.interp(tokens, x, y))
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        return float(y[-1] + slope * (tokens - x[-1]))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CostCurve:
        """From `{tokens: [...], seconds: [...]}`."""
        try:
            return cls(tuple(int(t) for t in values["tokens"]), tuple(float(s) for s in values["seconds"]))
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"a cost curve is {{tokens: [...], seconds: [...]}}, got {values!r}") from None

    def as_dict(self) -> dict[str, list]:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds)}


@torch.no_grad()
def measure_cost_curve(model: Any, context: int = 32, tokens: tuple[int, ...] = CURVE_TOKENS, repeats: int = 3) -> CostCurve:
    """The forward time of `model` on its device against the tokens in the forward: n rows of one new token each,
    every row with `context` cached tokens (the median of `repeats` timings per n)."""
    seconds = []
    vocab = model.get_input_embeddings().weight.shape[0]
    for n in tokens:
        timings = []
        for _ in range(repeats):
            cache = BatchCache(model, n)
            cache.feed({row: [(row * 7 + i) % vocab for i in range(context)] for row in range(n)})
            synchronize(cache.device)
            start = time.perf_counter()
            cache.feed({row: [row % vocab] for row in range(n)})
            synchronize(cache.device)
            timings.append(time.perf_counter() - start)
        seconds.append(float(np.median(timings)))
    return CostCurve(tuple(tokens), tuple(seconds))


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def request_rounds(record: Any) -> list[tuple[int, int]]:
    """A run's rounds as (candidates k, tokens yielded): a + 1 each, the last one what the run emitted after the
    others (less where it ended at a stop token or at max_new_tokens)."""
    yielded = [a + 1 for a in record.accepted_per_round]
    if yielded:
        yielded[-1] = record.emitted - sum(yielded[:-1])
    return list(zip(record.drafted_per_round, yielded))


def serve(requests: list[list[tuple[int, int]]], batch_size: int, draft: CostCurve, target: CostCurve) -> dict[str, float]:
    """Serve `requests` (each a list of rounds (candidates k, tokens yielded), `request_rounds`) `batch_size` at a time
    with continuous batching; the modelled seconds, tokens and throughput (module docstring)."""
    queue = deque(deque(rounds) for rounds in requests if rounds)
    slots: list[deque] = []
    seconds = tokens = rounds_run = 0.0
    while queue or slots:
        while queue and len(slots) < batch_size:
            slots.append(queue.popleft())
        step = [slot.popleft() for slot in slots]
        drafted = [k for k, _ in step]
        seconds += sum(draft(sum(k >= s for k in drafted)) for s in range(1, max(drafted) + 1))
        seconds += target(sum(k + 1 for k in drafted))
        tokens += sum(yielded for _, yielded in step)
        rounds_run += 1
        slots = [slot for slot in slots if slot]
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds if seconds else float("nan"),
            "batched_rounds": rounds_run}


def serving_table(records: list[Any], tuned: dict[str, float], batch_sizes: list[int], draft: CostCurve,
                  target: CostCurve, split: str = "test") -> list[dict[str, Any]]:
    """Per policy at its tuned threshold and per batch size: the modelled throughput of its `split` runs served
    together, and its ratio to the tuned constant K's at the same batch size."""
    rows = []
    for policy, threshold in tuned.items():
        runs = [r for r in records if r.split == split and r.policy == policy and r.threshold == threshold]
        if not runs or policy in NOT_SERVED or any(len(r.drafted_per_round) != len(r.accepted_per_round) for r in runs):
            continue
        requests = [request_rounds(r) for r in runs]
        for size in batch_sizes:
            rows.append({"policy": policy, "threshold": threshold, "batch_size": size, "requests": len(runs),
                         **serve(requests, size, draft, target)})
    for row in rows:
        constant = next((r for r in rows if r["policy"] == "constant_k" and r["batch_size"] == row["batch_size"]), None)
        row["vs_constant_k"] = row["tokens_per_s"] / constant["tokens_per_s"] - 1 if constant else None
    return rows


def best_per_batch_size(rows: list[dict[str, Any]]) -> dict[int, str]:
    """The policy with the highest throughput at each batch size (the oracle left out: it knows the outcomes)."""
    best: dict[int, dict[str, Any]] = {}
    for row in rows:
        if row["policy"] != "oracle" and (row["batch_size"] not in best
                                          or row["tokens_per_s"] > best[row["batch_size"]]["tokens_per_s"]):
            best[row["batch_size"]] = row
    return {size: row["policy"] for size, row in sorted(best.items())}
