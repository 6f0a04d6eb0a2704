"""The work plan: (prompt, sample) rows, sorted by length, cut into fixed batches and shards.

The plan depends only on the inputs and settings, never on the number of processes: every rank
sees the same shards, and shard `i` always holds the same rows. That is what makes the output
identical for 1 or N ranks, and what lets a resumed run skip the shards that are already written.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    """One output row: a prompt, which sample of it, its mixing ratio, and an imported response if any."""

    prompt_id: str
    sample_index: int
    prompt_ids: tuple[int, ...]
    target_ratio: float
    response_ids: tuple[int, ...] | None = None


@dataclass
class Shard:
    """A unit of work and of output: consecutive batches written as one Arrow file."""

    index: int
    batches: list[list[WorkItem]]


def row_seed(seed: int, prompt_id: str, sample_index: int, stream: str) -> int:
    """A 63-bit seed for one row's random stream (`response` or `label`), independent of everything else."""
    digest = hashlib.sha256(f"{seed}\x00{prompt_id}\x00{sample_index}\x00{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def build_plan(items: list[WorkItem], batch_size: int, rows_per_shard: int) -> list[Shard]:
    """Sort rows by prompt length (longest first, so memory trouble shows at once) and cut them into shards."""
    ordered = sorted(enumerate(items), key=lambda pair: (-len(pair[1].prompt_ids), pair[0]))
    rows = [item for _, item in ordered]
    batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    per_shard = rows_per_shard // batch_size
    return [Shard(index, batches[start : start + per_shard]) for index, start in enumerate(range(0, len(batches), per_shard))]
