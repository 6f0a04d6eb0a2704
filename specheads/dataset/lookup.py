"""Free drafts' labels on disk (`specheads gen --drafter.kind lookup|suffix`, `data_gen.lookup_labels`): gen's shard
format under a manifest of their own format, read with gen's checks of every shard (`store.load_labelled`)."""

from __future__ import annotations

from pathlib import Path

import datasets

from specheads.dataset.store import load_labelled, read_manifest
from specheads.plumbing.errors import UsageError

LOOKUP_FORMAT = "specheads-lookup-labels"


def load_lookup(out: str | Path) -> datasets.Dataset:
    """The rows of a finished lookup-label folder, memory-mapped, every shard checked against its record."""
    manifest = read_manifest(Path(out))
    if manifest is None or manifest.get("format") != LOOKUP_FORMAT:
        raise UsageError(f"{out} holds no lookup labels; make them with `specheads gen --drafter.kind lookup --out {out}`")
    return load_labelled(out, format=LOOKUP_FORMAT)
