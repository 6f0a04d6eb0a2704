"""Free drafts' labels on disk (`specheads gen --drafter.kind lookup|suffix`, `data_gen.lookup_labels`): gen's shard
format under a manifest of their own format, read with gen's checks of every shard (`store.load_labelled`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import numpy as np

from specheads.dataset.store import load_labelled, read_manifest
from specheads.plumbing.errors import UsageError

LOOKUP_FORMAT = "specheads-lookup-labels"


def load_lookup(out: str | Path) -> datasets.Dataset:
    """The rows of a finished lookup-label folder, memory-mapped, every shard checked against its record."""
    manifest = read_manifest(Path(out))
    if manifest is None or manifest.get("format") != LOOKUP_FORMAT:
        raise UsageError(f"{out} holds no lookup labels; make them with `specheads gen --drafter.kind lookup --out {out}`")
    return load_labelled(out, format=LOOKUP_FORMAT)


def proposal_products(labels: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(reach, survival) of every proposed token in flat per-token arrays (a proposal starts at position 1): reach is
    the product of the labels of the earlier tokens of its proposal, survival the product up to and with it."""
    reach = np.ones(len(labels), dtype=np.float64)
    survival = np.ones(len(labels), dtype=np.float64)
    running = 1.0
    for index, (label, position) in enumerate(zip(labels, positions)):
        if position == 1:
            running = 1.0
        reach[index] = running
        running *= float(label)
        survival[index] = running
    return reach, survival


TOKEN_COLUMNS = ("label", "position", "start", "round_start", "token_features")


def flat_tokens(rows: Any, with_states: bool) -> dict[str, np.ndarray]:
    """Every labelled proposed token of lookup rows (a datasets.Dataset or dicts), flat: `features` [N, F], `label`,
    `reach`, `survival`, `position`, `start`, `round_start`, `row` (its row's index), and with `with_states` the
    target's state at the last verified position `target_state` [N, h]."""
    parts: dict[str, list[np.ndarray]] = {}
    if hasattr(rows, "select_columns"):  # a dataset: decode only what is read (the states are the bulk of a row)
        rows = rows.select_columns([*TOKEN_COLUMNS, *(["target_features"] if with_states else [])]).with_format("numpy")
    for index, row in enumerate(rows):
        count = len(row["label"])
        if not count:
            continue
        label, position = np.asarray(row["label"], np.float64), np.asarray(row["position"], np.int64)
        reach, survival = proposal_products(label, position)
        start = np.asarray(row["start"], np.int64)
        found = {"features": np.asarray(row["token_features"], np.float32).reshape(count, -1), "label": label,
                 "reach": reach, "survival": survival, "position": position, "start": start,
                 "round_start": np.asarray(row["round_start"], bool), "row": np.full(count, index)}
        if with_states:
            found["target_state"] = np.asarray(row["target_features"], np.float32)[start]
        for name, value in found.items():
            parts.setdefault(name, []).append(value)
    if not parts:
        raise UsageError("the lookup labels hold no proposed token (no prompt repeats anything); label prompts that "
                         "copy from their context")
    return {name: np.concatenate(values) for name, values in parts.items()}
