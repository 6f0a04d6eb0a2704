"""Facts about files computed once per file version and cached: whole-file sha256 digests, value checks.

A model's fingerprint must change whenever any byte of its weights does (a fine-tune of the same shape
included), so every file is hashed whole; a labelled shard's values are range-checked before anything
trains on them. A safetensors file is hashed with its header's metadata keys in sorted order: safetensors writes
that map in a per-process hash order, so the same tensors saved twice (the embedded model converted on two machines)
would otherwise get two fingerprints. Both read whole files, so the result is kept in `$SPECHEADS_CACHE/file-facts.jsonl`, keyed by
the file's path, and reused while its size and modification time are unchanged.

The cache is a journal: read once per process, one line appended per new fact (a later line wins), so recording
n facts costs O(n) in all. When it has grown to twice the facts it held after its last compaction, it is rewritten
(atomically) with the latest fact of each file that still exists unchanged.
"""

from __future__ import annotations

import json
import struct
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


def cached_weights_sha256(path: Path) -> str:
    """The hex sha256 of a weight or config file (cached): whole, with a safetensors header's metadata in sorted
    order."""
    return str(cached_fact(path, "weights-sha256", weights_sha256))


def weights_sha256(path: Path) -> str:
    """sha256 of the file at `path`, hashed as if a safetensors header's `__metadata__` keys were written in sorted
    order; a file already written so (or any other file) hashes as its bytes do."""
    canonical = canonical_safetensors_header(path) if path.suffix == ".safetensors" else None
    return file_sha256(path) if canonical is None else file_sha256(path, head=struct.pack("<Q", len(canonical)) + canonical)


def canonical_safetensors_header(path: Path) -> bytes | None:
    """The header of the safetensors file at `path` with its metadata keys sorted, or None when that is the header
    as written (or the file is no safetensors this can re-serialise byte for byte)."""
    with open(path, "rb") as handle:
        size_bytes = handle.read(8)
        if len(size_bytes) < 8:
            return None
        size = struct.unpack("<Q", size_bytes)[0]
        header = handle.read(size) if size < 1 << 30 else b""
    try:
        text = header.decode("utf-8")
        parsed = json.loads(text)
    except ValueError:
        return None
    metadata = parsed.get("__metadata__") if isinstance(parsed, dict) else None
    body = text.rstrip(" ")
    if not isinstance(metadata, dict) or compact_json(parsed) != body:
        return None  # nothing to reorder, or written by a serialiser this would not reproduce
    canonical = compact_json({**parsed, "__metadata__": dict(sorted(metadata.items()))})
    if canonical == body:
        return None
    return (canonical + text[len(body):]).encode("utf-8")


def compact_json(value: Any) -> str:
    """JSON as safetensors (serde_json) writes a header: no spaces, non-ASCII characters as they are."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


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
