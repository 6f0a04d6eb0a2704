"""Facts about files computed once per file version and cached: whole-file sha256 digests, value checks.

A model's fingerprint must change whenever any byte of its weights does (a fine-tune of the same shape
included), so every file is hashed whole; a labelled shard's values are range-checked before anything
trains on them. Both read whole files, so the result is kept in `$SPECHEADS_CACHE/file-facts.json`, keyed by
the file's path, and reused while its size and modification time are unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specheads.data_gen.embedded import cache_root, file_sha256
from specheads.files import write_json_atomic

CACHE_FILE = "file-facts.json"


_loaded: dict[Path, dict[str, Any]] = {}  # each cache file's entries, read once per process


def cached_fact(path: Path, kind: str, compute: Callable[[Path], Any]) -> Any:
    """`compute(path)` for the file at `path`, from the cache while its size and mtime are unchanged. Nothing is
    cached when `compute` raises."""
    resolved = path.resolve()
    stat = resolved.stat()
    key, stamp = f"{kind}:{resolved}", [stat.st_size, stat.st_mtime_ns]
    cache_path = cache_root() / CACHE_FILE
    if cache_path not in _loaded:
        try:
            _loaded[cache_path] = dict(json.loads(cache_path.read_text()))
        except (OSError, ValueError, TypeError):
            _loaded[cache_path] = {}
    cache = _loaded[cache_path]
    entry = cache.get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry["value"]
    value = compute(resolved)
    cache[key] = {"stamp": stamp, "value": value}
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache_path, cache)
    except OSError:
        pass  # a read-only cache only costs computing again next time
    return value


def cached_sha256(path: Path) -> str:
    """The hex sha256 of the whole file at `path` (cached)."""
    return str(cached_fact(path, "sha256", file_sha256))
