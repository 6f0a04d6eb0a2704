"""The labelled dataset on disk: Arrow shards written atomically, `manifest.json`, and a dataset card.

Layout of an output folder:
    manifest.json        the fingerprint and counts (DESIGN.md); `complete` is false while a run is going
    README.md            the dataset card
    shards/shard-NNNNN.arrow   one Arrow file per planned shard, memory-mapped by `load_labelled`
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import datasets
import numpy as np
from datasets.arrow_writer import ArrowWriter

from specheads.errors import UsageError

MANIFEST = "manifest.json"
SHARDS = "shards"
FORMAT = "specheads-labels"
FORMAT_VERSION = 1
PER_POSITION_FLOATS = ("logp", "logq", "accept", "beta", "entropy", "top1")
PER_POSITION_IDS = ("target_ids", "draft_ids", "mixed_ids")


def row_features(hidden_size: int | None) -> datasets.Features:
    """The Arrow schema of one row; `features` only when hidden states are stored."""
    ints = datasets.List(datasets.Value("int32"))
    floats = datasets.List(datasets.Value("float32"))
    schema: dict[str, Any] = {
        "prompt_id": datasets.Value("string"),
        "sample_index": datasets.Value("int32"),
        "target_ratio": datasets.Value("float32"),
        "prompt_ids": ints,
        **{name: ints for name in PER_POSITION_IDS},
        "is_draft": datasets.List(datasets.Value("bool")),
        **{name: floats for name in PER_POSITION_FLOATS},
    }
    if hidden_size:
        schema["features"] = datasets.Array2D(shape=(None, hidden_size), dtype="float16")
    return datasets.Features(schema)


def shard_path(out: Path, index: int) -> Path:
    """Where shard `index` lives."""
    return out / SHARDS / f"shard-{index:05d}.arrow"


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def publish(temporary: str, final: Path) -> None:
    """Give a finished temporary file the usual permissions and move it into place atomically."""
    os.chmod(temporary, 0o666 & ~current_umask())
    os.replace(temporary, final)


def usual_permissions(folder: Path) -> None:
    """Give a folder built in a private temporary directory (mkdtemp's 0700), and everything in it, the permissions
    a plain mkdir and open would have given under the umask, so that others can read what is published."""
    umask = current_umask()
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def atomic_path(final: Path) -> Iterator[str]:
    """A temporary path beside `final`, moved onto it when the block ends without error (else removed)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(handle)
    try:
        yield temporary
        publish(temporary, final)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_shard(out: Path, index: int, columns: dict[str, list], schema: datasets.Features) -> Path:
    """Write one shard atomically: a reader sees the whole file or none of it."""
    final = shard_path(out, index)
    with atomic_path(final) as temporary:
        writer = ArrowWriter(features=schema, path=temporary)
        writer.write_batch(columns)
        writer.finalize()
        writer.close()
    return final


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write JSON via a temporary file and a rename."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write text via a temporary file and a rename."""
    with atomic_path(path) as temporary:
        Path(temporary).write_text(text, encoding="utf-8")


def read_manifest(out: Path) -> dict | None:
    """The folder's manifest, or None where there is none."""
    path = Path(out) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UsageError(f"{path} is not valid JSON ({error.msg}); remove the folder or pass --overwrite") from error


def load_labelled(out: str | os.PathLike, require_complete: bool = True) -> datasets.Dataset:
    """The labelled rows of a finished `specheads gen` folder, memory-mapped (nothing is read into RAM)."""
    out = Path(out)
    manifest = read_manifest(out)
    if manifest is None or manifest.get("format") != FORMAT:
        raise UsageError(f"{out} holds no specheads labelled dataset (no {MANIFEST}); run `specheads gen --out {out}` first")
    if require_complete and not manifest.get("complete"):
        raise UsageError(f"{out} holds an unfinished run; run the same `specheads gen` command again to finish it")
    files = [shard_path(out, i) for i in range(manifest["plan"]["num_shards"])]
    missing = [f.name for f in files if not f.is_file()]
    if require_complete and missing:
        raise UsageError(f"{out} is missing shards ({', '.join(missing[:3])}); run the same `specheads gen` command again")
    parts = [datasets.Dataset.from_file(str(f)) for f in files if f.is_file()]
    if not parts:
        raise UsageError(f"{out} has no shards yet; run `specheads gen --out {out}`")
    return datasets.concatenate_datasets(parts)


def shard_statistics(out: Path, num_shards: int) -> dict[str, float]:
    """Counts and means over all shards, reading only the small columns."""
    rows = tokens = drafted = 0
    accept_sum = beta_sum = 0.0
    for index in range(num_shards):
        shard = datasets.Dataset.from_file(str(shard_path(out, index))).with_format("numpy")
        for accept, beta, is_draft in zip(shard["accept"], shard["beta"], shard["is_draft"]):
            accept_sum += float(np.sum(accept))
            beta_sum += float(np.sum(beta))
            tokens += len(accept)
            drafted += int(np.sum(is_draft))
        rows += len(shard)
    return {
        "rows": rows,
        "labelled_tokens": tokens,
        "draft_tokens": drafted,
        "mean_accept": accept_sum / max(tokens, 1),
        "mean_beta": beta_sum / max(tokens, 1),
    }
