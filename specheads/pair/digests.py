"""Facts about files computed once per file version and cached: whole-file sha256 digests, value checks.

A model's fingerprint must change whenever any byte of its weights does (a fine-tune of the same shape
included), so every file is hashed whole; a labelled shard's values are range-checked before anything
trains on them. Both read whole files, so the result is kept in `$SPECHEADS_CACHE/file-facts.jsonl`, keyed by
the file's path, and reused while its size and modification time are unchanged.

The cache is a journal: read once per process, one line appended per new fact (a later line wins), so recording
n facts costs O(n) in all. When it has grown to twice the facts it held after its last compaction, it is rewritten
(atomically) with the latest fact of each file that still exists unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specheads.pair.embedded import cache_root, file_sha256
from specheads.plumbing.files import write_text_atomic

CACHE_FILE = "file-facts.jsonl"
COMPACT_AFTER = 1000
"""A journal is never compacted below this many lines."""

_loaded: dict[Path, dict[str, dict[str, Any]]] = {}  # each journal's facts by key, read once per process


def cached_fact(path: Path, kind: str, compute: Callable[[Path], Any]) -> Any:
    """`compute(path)` for the file at `path`, from the cache while its size and mtime are unchanged. Nothing is
    cached when `compute` raises."""
    resolved = path.resolve()
    key, stamp = f"{kind}:{resolved}", file_stamp(resolved)
    journal = cache_root() / CACHE_FILE
    facts = _loaded.get(journal)
    if facts is None:
        facts = _loaded[journal] = load_journal(journal)
    entry = facts.get(key)
    if entry is not None and entry.get("stamp") == stamp:
        return entry["value"]
    entry = {"key": key, "stamp": stamp, "value": compute(resolved)}
    facts[key] = entry
    append_line(journal, json.dumps(entry))
    return entry["value"]


def cached_sha256(path: Path) -> str:
    """The hex sha256 of the whole file at `path` (cached)."""
    return str(cached_fact(path, "sha256", file_sha256))


def file_stamp(path: Path) -> list[int]:
    """What identifies a version of the file: its size and modification time."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def load_journal(journal: Path) -> dict[str, dict[str, Any]]:
    """The journal's facts by key (the last line of each key wins; a line cut off by a killed writer is skipped),
    compacted first when it has grown to twice its size after the last compaction."""
    try:
        lines = journal.read_text(encoding="utf-8").splitlines()
    except OSError:  # none yet, or unreadable: an empty cache only costs computing again
        lines = []
    facts: dict[str, dict[str, Any]] = {}
    compacted_size = 0
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("key"), str) and "stamp" in entry and "value" in entry:
            facts[entry["key"]] = entry
        elif isinstance(entry, dict) and isinstance(entry.get("compacted"), int):
            compacted_size = entry["compacted"]
    if len(lines) > max(COMPACT_AFTER, 2 * compacted_size):
        facts = {key: entry for key, entry in facts.items() if still_current(key, entry)}
        rewrite_journal(journal, facts)
    return facts


def still_current(key: str, entry: dict[str, Any]) -> bool:
    """True while the file a fact is about exists with the size and mtime it had."""
    try:
        return file_stamp(Path(key.split(":", 1)[1])) == entry["stamp"]
    except OSError:
        return False


def rewrite_journal(journal: Path, facts: dict[str, dict[str, Any]]) -> None:
    """Replace the journal atomically by one line per fact, after a line recording how many there are."""
    lines = [json.dumps({"compacted": len(facts)}), *(json.dumps(entry) for entry in facts.values())]
    try:
        write_text_atomic(journal, "\n".join(lines) + "\n")
    except OSError:
        pass  # a read-only cache only costs computing again next time


def append_line(journal: Path, line: str) -> None:
    """Append one line to the journal (one short write, so that processes appending at once do not mix lines)."""
    try:
        journal.parent.mkdir(parents=True, exist_ok=True)
        with open(journal, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
    except OSError:
        pass  # a read-only cache only costs computing again next time
