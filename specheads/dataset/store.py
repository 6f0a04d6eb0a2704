"""The labelled dataset on disk: Arrow shards written atomically, `manifest.json`, and a dataset card.

Layout of an output folder:
    manifest.json        the fingerprint and counts (docs/data.md); `complete` is false while a run is going
    README.md            the dataset card
    shards/shard-NNNNN.arrow   one Arrow file per planned shard, memory-mapped by `load_labelled`
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets.arrow_writer import ArrowWriter

from specheads.dataset.shards import (
    arrow_fingerprint,
    changed_bytes,
    check_shard_values,
    read_table,
    shard_path,
    shard_problem,
    write_record,
)
from specheads.dataset.storage import ARROW_DTYPES
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import atomic_path

MANIFEST = "manifest.json"
FORMAT = "specheads-labels"
FORMAT_VERSION = 2  # 2: the manifest keeps each shard's record (run, rows, bytes, sha256)
PER_POSITION_FLOATS = ("logp", "logq", "accept", "beta", "entropy", "top1", "top2")  # top2: from labeller 3 on
PER_POSITION_IDS = ("target_ids", "draft_ids", "mixed_ids")


@dataclass(frozen=True)
class DrafterColumns:
    """The columns a feature drafter's data adds (`data_gen.drafter_labels`): `depth` always, `drafter_score` where the
    drafter predicts its acceptance, `markov_features` [n + 1, markov_rank] where it has a Markov head."""

    markov_rank: int = 0
    scores: bool = False


def row_features(hidden_size: int | None, features_dtype: str = "float16",
                 target_hidden_size: int | None = None, siblings: bool = False,
                 drafter: DrafterColumns | None = None) -> datasets.Features:
    """The Arrow schema of one row; `features` only when hidden states are stored (bfloat16 as its uint16 bits),
    `target_features` only when the target's states are stored too (`target_states`), the `sibling_*` columns only
    with `sibling_labels`, a feature drafter's columns with `drafter` (`data_gen.drafter_labels`)."""
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
    if siblings:
        schema.update(sibling_ids=ints, sibling_accept=floats, sibling_beta=floats, sibling_logq=floats)
    if hidden_size:
        schema["features"] = datasets.Array2D(shape=(None, hidden_size), dtype=ARROW_DTYPES[features_dtype])
    if drafter is not None:
        schema["depth"] = ints
        if drafter.scores:
            schema["drafter_score"] = floats
        if drafter.markov_rank:
            schema["markov_features"] = datasets.Array2D(shape=(None, drafter.markov_rank), dtype=ARROW_DTYPES[features_dtype])
    if target_hidden_size:
        schema["target_features"] = datasets.Array2D(shape=(None, target_hidden_size), dtype=ARROW_DTYPES[features_dtype])
    return datasets.Features(schema)


def write_shard(out: Path, index: int, columns: dict[str, list], schema: datasets.Features, run: str) -> Path:
    """Write one shard atomically (a reader sees the whole file or none of it), carrying `run` (the data fingerprint)
    in its metadata, with its record beside it (`data_gen.shards`), written just before the shard appears."""
    final = shard_path(out, index)
    with atomic_path(final) as temporary:
        writer = ArrowWriter(features=schema, path=temporary, fingerprint=arrow_fingerprint(run, index))
        writer.write_batch(columns)
        writer.finalize()
        writer.close()
        write_record(out, index, run, len(columns["prompt_id"]), Path(temporary))
    return final


def read_manifest(out: Path) -> dict | None:
    """The folder's manifest, or None where there is none."""
    path = Path(out) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UsageError(f"{path} is not valid JSON ({error.msg}); remove the folder or pass --overwrite") from error


def load_labelled(out: str | os.PathLike, require_complete: bool = True, format: str = FORMAT) -> datasets.Dataset:
    """The labelled rows of a finished `specheads gen` folder, memory-mapped (nothing is read into RAM).

    Each shard is checked against the manifest's record of it (present, size, rows, the run that wrote it, and the
    sha256 of its bytes, hashed once per file version: ~1.1 GB/s, about 60 ms for the demo's 70 MB) and its values
    are range-checked once per file version; a bad shard is refused by name with the command that relabels it.
    `format` is the manifest's (free drafts' lookup labels have their own: `data_gen.lookup_labels`)."""
    out = Path(out)
    manifest = read_manifest(out)
    if manifest is None or manifest.get("format") != format:
        raise UsageError(f"{out} holds no specheads labelled dataset (no {MANIFEST}); run `specheads gen --out {out}` first")
    if require_complete and not manifest.get("complete"):
        raise UsageError(f"{out} holds an unfinished run; run the same `specheads gen` command again to finish it")
    records = manifest.get("shards")  # per-shard records: written by format 2 and later

    def refuse(path: Path, problem: str) -> None:
        raise UsageError(f"{path} {problem}; run the same `specheads gen` command again (the one that made {out}; its "
                         f"options are under `config` in {out / MANIFEST}): it relabels exactly the shards that fail")

    parts = []
    for index in range(manifest["plan"]["num_shards"]):
        path = shard_path(out, index)
        if records is not None:
            problem = shard_problem(out, index, manifest["fingerprint"], records[index], deep=False)
            if problem:
                refuse(path, problem)
        elif not path.is_file():
            if require_complete:
                raise UsageError(f"{path} is missing; relabel the folder with `specheads gen ... --overwrite`")
            continue
        try:
            parts.append(datasets.Dataset.from_file(str(path)))
        except Exception as error:  # pyarrow raises several types for a damaged file
            raise UsageError(f"{path} is not a readable Arrow shard ({' '.join(str(error).split())[:100]}); run the "
                             "same `specheads gen` command again to relabel it") from None
        check_shard_values(path)  # before the digest: a value out of range is named by its row
        problem = changed_bytes(path, records[index]) if records is not None else None
        if problem:
            refuse(path, problem)
    if not parts:
        raise UsageError(f"{out} has no shards yet; run `specheads gen --out {out}`")
    return datasets.concatenate_datasets(parts)


def shard_statistics(out: Path, num_shards: int) -> dict[str, Any]:
    """Counts and means over all shards, reading only the small columns, and what the shards take on disk."""
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
        "storage": storage_statistics(out, num_shards, rows, tokens),
    }


def storage_statistics(out: Path, num_shards: int, rows: int, tokens: int) -> dict[str, Any]:
    """Bytes on disk per labelled token, measured on the shard files: in all, and in the `features` column's Arrow
    buffers; and how many of the rows' n + 1 draft states were kept."""
    shard_bytes = state_bytes = states_kept = 0
    stored = False
    for index in range(num_shards):
        path = shard_path(out, index)
        shard_bytes += path.stat().st_size
        table = read_table(path)
        if "features" in table.column_names:
            stored = True
            for chunk in table.column("features").chunks:
                state_bytes += chunk.nbytes
                states_kept += len((chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk).flatten())
    per_token = max(tokens, 1)
    return {"shard_bytes": shard_bytes, "bytes_per_labelled_token": shard_bytes / per_token,
            "state_bytes_per_labelled_token": state_bytes / per_token,
            "states_kept": states_kept, "states_of_all_positions": tokens + rows if stored else 0}
