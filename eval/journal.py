"""Resuming an interrupted `specheads eval`: its finished decoding runs, written down as they finish.

The sweep appends each finished batch of runs (one setting, up to `--decode-batch-size` prompts) to
`OUT/runs.partial.jsonl` as one JSON line, after a first line recording what a run depends on: the decoding
context (`eval.reuse.decoding_context`) and the head (its weights, config with its calibration, the state it
reads). A re-run into the same folder takes every run the journal holds whose prompt sits at the same
position, and decodes only the rest; a run's seed comes from its prompt's position, so the report equals an
uninterrupted one apart from wall times. A line a kill tore is dropped. Another context starts afresh;
another head keeps the head-free runs (as `--reuse-runs` would). Once the report is written the journal is
removed.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specheads.eval.reuse import HEAD_FREE_POLICIES, context_differences, run_key, same_position_prompts
from specheads.eval.sweep import RunKey, RunRecord
from specheads.eval.tuned import head_differences
from specheads.plumbing.files import write_text_atomic

JOURNAL_FILE = "runs.partial.jsonl"
MARK = "specheads eval decoding runs"


@dataclass
class RunJournal:
    """An eval folder's journal, open for appends: the runs it already held and, where some were dropped, why."""

    path: Path
    finished: dict[RunKey, RunRecord] = field(default_factory=dict)
    note: str | None = None

    def append(self, records: list[RunRecord]) -> None:
        """Write a finished batch as one line, on disk before this returns (a kill tears at most this line)."""
        line = json.dumps({"runs": [asdict(record) for record in records]}) + "\n"
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def remove(self) -> None:
        """Delete the journal (the report's runs.json now holds every run)."""
        self.path.unlink(missing_ok=True)


def json_ready(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples become lists), so that it compares equal to what was written."""
    return json.loads(json.dumps(value))


def read_journal(path: Path) -> tuple[dict[str, Any] | None, list[list[dict[str, Any]]]]:
    """The journal's header and its batches of runs, up to the first line that is not a whole batch (a kill tore
    it); (None, []) when there is no readable journal."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError):
        return None, []
    header = parsed(lines[0])
    if header is None or header.get("journal") != MARK:
        return None, []
    batches = []
    for line in lines[1:]:
        batch = parsed(line)
        if batch is None or not whole_batch(batch.get("runs")):
            break
        batches.append(batch["runs"])
    return header, batches


def parsed(line: str) -> dict[str, Any] | None:
    """A line's JSON object, or None for a torn or empty line."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def whole_batch(runs: Any) -> bool:
    """Whether `runs` is a list of run records."""
    try:
        return isinstance(runs, list) and all(isinstance(RunRecord(**row), RunRecord) for row in runs)
    except TypeError:
        return False


def still_valid(header: dict[str, Any], batches: list[list[dict[str, Any]]], context: dict[str, Any],
                head: dict[str, Any], path: Path) -> tuple[list[list[dict[str, Any]]], str | None]:
    """The journalled runs that this context and head would decode alike (prompt at the same position; a head run
    only for the same head), and a line saying what was dropped, if anything was for a reason the user chose."""
    earlier = header.get("context") or {}
    differs = context_differences(earlier, context)
    if differs:
        return [], f"{path} holds runs decoded with another {', '.join(differs)}: starting afresh"
    same_position = same_position_prompts(earlier, context)
    other_head = head_differences(header.get("head") or {}, head)
    kept = [[row for row in batch if row["prompt_id"] in same_position
             and (not other_head or row["policy"] in HEAD_FREE_POLICIES)] for batch in batches]
    note = (f"{path} holds runs of another head (differs in {', '.join(other_head)}): keeping its head-free runs only"
            if other_head else None)
    return [batch for batch in kept if batch], note


def discard_empty_journal(folder: Path) -> None:
    """Remove the eval folder's journal when it holds no finished run (a run refused after opening it made it, and
    there is nothing in it to resume)."""
    path = folder / JOURNAL_FILE
    header, batches = read_journal(path)
    if header is not None and not batches:
        path.unlink(missing_ok=True)


def open_journal(folder: Path, context: dict[str, Any], head: dict[str, Any]) -> RunJournal:
    """The journal of the eval folder `folder` for runs of `context` (eval.reuse.decoding_context) and `head`
    (the evaluated head as the report records it), holding the runs an interrupted eval of the same context and
    head finished there. The file is written afresh with only those runs, so appends follow a whole line."""
    path = folder / JOURNAL_FILE
    context, head = json_ready(context), json_ready(head)
    header, batches = read_journal(path)
    kept, note = still_valid(header, batches, context, head, path) if header else ([], None)
    lines = [{"journal": MARK, "context": context, "head": head}, *({"runs": batch} for batch in kept)]
    write_text_atomic(path, "".join(json.dumps(line) + "\n" for line in lines))
    finished = {run_key(record): record for record in (RunRecord(**row) for batch in kept for row in batch)}
    return RunJournal(path, finished, note)
