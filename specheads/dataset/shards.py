"""What each shard records about itself, and the checks that decide whether a shard can be trusted.

Beside `shards/shard-NNNNN.arrow` the writer keeps `shard-NNNNN.json`: the run (data fingerprint) that wrote
it, its rows, bytes and sha256. The Arrow file carries the run in its own metadata too. `specheads gen`
copies the records into the manifest when it finishes; readers (train, eval: `store.load_labelled`) compare each
shard with its record (size, rows, run and the sha256 of its bytes: a byte changed in place keeps the size) and
range-check its values once per file version; gen re-verifies the sha256 of every shard before it trusts one, and
relabels exactly the shards that fail. Only a shard proven bad fails: a file that cannot
be read at all (an I/O error, a permission) stops the check with an error and nothing is deleted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from specheads.dataset.storage import float_values
from specheads.pair.digests import cached_fact, cached_sha256
from specheads.pair.embedded import file_sha256
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic

SHARDS = "shards"
RUN_PREFIX = "specheads-run-"


def shard_path(out: Path, index: int) -> Path:
    """Where shard `index` lives."""
    return out / SHARDS / f"shard-{index:05d}.arrow"


def record_path(out: Path, index: int) -> Path:
    """Where shard `index`'s record lives."""
    return shard_path(out, index).with_suffix(".json")


def arrow_fingerprint(run: str, index: int) -> str:
    """The fingerprint a shard's Arrow metadata carries (datasets reads it as the shard's own fingerprint)."""
    return f"{RUN_PREFIX}{run}-shard{index:05d}"


def write_record(out: Path, index: int, run: str, rows: int, written: Path) -> dict[str, Any]:
    """Record shard `index` from `written`, the finished file about to become it: the run that wrote it, its rows,
    bytes and sha256 (atomic). Written before the shard is moved into place, so a shard never exists without its
    record (a run killed in between leaves a record of a missing shard, which is labelled again)."""
    record = {"run": run, "rows": rows, "bytes": written.stat().st_size, "sha256": file_sha256(written)}
    write_json_atomic(record_path(out, index), record)
    return record


def read_record(out: Path, index: int) -> dict[str, Any] | None:
    """Shard `index`'s record, or None where there is none or it is not a JSON object (written atomically, so damaged).
    Any other OSError reading it propagates: a record that cannot be read is not a missing one."""
    try:
        record = json.loads(record_path(out, index).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_table(path: Path) -> pa.Table:
    """The shard's rows, memory-mapped."""
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all()


def shard_run(table: pa.Table) -> str | None:
    """The run recorded in a shard's Arrow metadata (None for shards written before it was recorded)."""
    metadata = json.loads((table.schema.metadata or {}).get(b"huggingface", b"{}"))
    fingerprint = str(metadata.get("fingerprint") or "")
    return fingerprint[len(RUN_PREFIX):].rsplit("-shard", 1)[0] if fingerprint.startswith(RUN_PREFIX) else None


def shard_problem(out: Path, index: int, run: str, record: dict[str, Any] | None, deep: bool) -> str | None:
    """Why shard `index` cannot be trusted as a shard of `run` with `record` (the shard's own record file when
    None), or None when it can. `deep` also compares the whole file's sha256 with the record's. Raises UsageError,
    naming the shard, when its files cannot be read to tell (a passing I/O error must not get a good shard deleted)."""
    path = shard_path(out, index)
    try:
        return _shard_problem(out, index, run, record, deep)
    except FileNotFoundError:  # gone while it was being checked
        return "is missing"
    except OSError as error:
        raise UsageError(unchecked(path, error)) from None


def unchecked(path: Path, error: Exception) -> str:
    """The one line for a shard whose files could not be read to check it."""
    reason = " ".join(str(getattr(error, "strerror", None) or error).split())[:100]
    where = getattr(error, "filename", None)
    reason += f" reading {where}" if where and str(where) != str(path) else ""
    return (f"{path} could not be checked ({reason}); nothing was deleted: make the folder readable again (storage, "
            "permissions) and run the same command again")


def _shard_problem(out: Path, index: int, run: str, record: dict[str, Any] | None, deep: bool) -> str | None:
    path = shard_path(out, index)
    record = record if record is not None else read_record(out, index)
    if not path.is_file():
        return "is missing"
    if record is None:
        return "has no record of the run that wrote it (it was cut off while being written)"
    if record.get("run") != run:
        return f"was written by another run (fingerprint {record.get('run')}, this dataset is {run})"
    size = path.stat().st_size
    if size != record.get("bytes"):
        return f"holds {size} bytes but {record.get('bytes')} were written (truncated or changed on disk)"
    try:
        table = read_table(path)
    except (pa.ArrowException, OSError) as error:  # pyarrow raises OSError for damaged content as well
        if file_sha256(path) == record.get("sha256"):  # the very bytes written: not the shard's fault
            raise UsageError(unchecked(path, error)) from None
        return f"is not a readable Arrow file ({' '.join(str(error).split())[:100]})"
    if table.num_rows != record.get("rows"):
        return f"holds {table.num_rows} rows but {record.get('rows')} were written"
    written_by = shard_run(table)
    if written_by != run:
        return f"carries run {written_by} in its Arrow metadata, not {run}"
    return _changed_bytes(path, record) if deep else None


def changed_bytes(path: Path, record: dict[str, Any]) -> str | None:
    """Why the shard at `path` cannot be trusted when its bytes no longer hash to `record`'s sha256 (a byte changed in
    place keeps the size, rows and run), or None. A reader hashes a shard once per version of the file (its size and
    mtime, `cached_sha256`), as the value check trusts them, so ranks and later runs pay nothing. Raises UsageError,
    naming the shard, when it cannot be read."""
    try:
        return _changed_bytes(path, record, cached_sha256)
    except OSError as error:
        raise UsageError(unchecked(path, error)) from None


def _changed_bytes(path: Path, record: dict[str, Any], sha256: Callable[[Path], str] | None = None) -> str | None:
    if (sha256 or file_sha256)(path) != record.get("sha256"):
        return "no longer has the sha256 recorded when it was written (changed on disk)"
    return None


LIMITS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], str]] = {
    "accept": (lambda v: (v >= 0) & (v <= 1), "outside [0, 1]"),
    "beta": (lambda v: (v >= 0) & (v <= 1), "outside [0, 1]"),
    "top1": (lambda v: (v >= 0) & (v <= 1), "outside [0, 1]"),
    "top2": (lambda v: (v >= 0) & (v <= 1), "outside [0, 1]"),
    "sibling_accept": (lambda v: (v >= 0) & (v <= 1), "outside [0, 1]"),
    "sibling_beta": (lambda v: (v >= 0) & (v <= 1), "outside [0, 1]"),
    "logq": (lambda v: np.isfinite(v) & (v <= 0), "not a finite log-probability"),
    "sibling_logq": (lambda v: np.isfinite(v) & (v <= 0), "not a finite log-probability"),
    "logp": (lambda v: v <= 0, "not a log-probability (−inf is allowed where the transform gives p = 0)"),
    "entropy": (lambda v: np.isfinite(v) & (v >= 0), "not a finite entropy"),
    "features": (lambda v: np.isfinite(float_values(v)), "not finite"),
    "target_features": (lambda v: np.isfinite(float_values(v)), "not finite"),
    "markov_features": (lambda v: np.isfinite(float_values(v)), "not finite"),
    "drafter_score": (lambda v: (v >= 0) & (v <= 1), "outside [0, 1]"),
    "depth": (lambda v: v >= 1, "not a depth (1, 2, ...)"),
}
"""Each stored column's valid values (NaN fails every test), and what a bad value is."""


def first_bad_value(column: pa.ChunkedArray, valid: Callable[[np.ndarray], np.ndarray]) -> tuple[int, float] | None:
    """(row, value) of the first value of a per-position list column (features: list of lists) that is not valid."""
    array = column.combine_chunks()
    array = array.storage if isinstance(array, pa.ExtensionArray) else array
    levels = []
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        offsets = array.offsets.to_numpy()
        levels.append(offsets - offsets[0])
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(~valid(values))
    if not len(bad):
        return None
    position = int(bad[0])
    for offsets in reversed(levels):
        position = int(np.searchsorted(offsets, position, side="right") - 1)
    return position, float(float_values(values[bad[:1]])[0])


def check_values(path: Path) -> bool:
    """Refuse a shard holding a label or state out of its range, naming the shard, row, prompt and column."""
    table = read_table(path)
    for name, (valid, what) in LIMITS.items():
        if name not in table.column_names:
            continue
        found = first_bad_value(table.column(name), valid)
        if found is not None:
            row, value = found
            prompt, sample = table.column("prompt_id")[row].as_py(), table.column("sample_index")[row].as_py()
            raise UsageError(f"{path} row {row} (prompt {prompt!r}, sample {sample}): {name} = {value:g} is {what}; the "
                             "shard is corrupt: run the same `specheads gen` command again to relabel shards that changed "
                             "on disk, or relabel the folder with --overwrite")
    return True


def check_shard_values(path: Path) -> None:
    """`check_values`, once per version of the file (cached by path, size and mtime)."""
    cached_fact(path, "label-ranges", check_values)
