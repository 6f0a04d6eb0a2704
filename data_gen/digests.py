"""Whole-file sha256 digests of model weights, computed once and cached by path, size and modification time.

A model's fingerprint must change whenever any byte of its weights does (a fine-tune of the same shape
included), so every file is hashed whole. Hashing a few GB takes seconds to minutes, so the digest is kept
in `$SPECHEADS_CACHE/file-digests.json` and reused while the file's size and mtime are unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

from data_gen.embedded import cache_root, file_sha256
from data_gen.store import write_json_atomic

CACHE_FILE = "file-digests.json"


def cached_sha256(path: Path) -> str:
    """The hex sha256 of the whole file at `path`, from the cache when its size and mtime are unchanged."""
    resolved = path.resolve()
    stat = resolved.stat()
    key, stamp = str(resolved), [stat.st_size, stat.st_mtime_ns]
    cache_path = cache_root() / CACHE_FILE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return str(entry["sha256"])
    digest = file_sha256(resolved)
    cache[key] = {"stamp": stamp, "sha256": digest}
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache_path, cache)
    except OSError:
        pass  # a read-only cache only costs hashing again next time
    return digest
