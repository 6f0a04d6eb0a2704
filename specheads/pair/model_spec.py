"""What a model spec says: where a model comes from and where it runs (`ModelSpec`).

The spec is plain data, read by the loading (`specheads.pair.models`, which also exports it) and by the placement checks
(`specheads.pair.placement`); it imports neither, so both sit above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelSpec:
    """Where a model comes from.

    Args:
        path: Hub id, local folder, `.gguf` file, or `embedded:smollm2`; empty for a draft derived from the target.
        revision: Hub branch, tag or commit (Hub ids only).
        gguf_file: GGUF file name inside `path` when `path` is a folder or Hub id.
        skip_layers: decoder layers to skip (0-based); with an empty `path` the draft is the target minus these.
        dtype: weights dtype: float32, bfloat16 or float16.
        device_map: spread the model over the rank's GPUs with accelerate (`auto`, `balanced`, `balanced_low_0`,
            `sequential`, or `{module: device}`); unset = the whole model on the rank's device (data_gen.placement).
        max_memory: memory per device for `device_map`, e.g. `{0: 70GiB, 1: 70GiB}`; GPUs count from the rank's
            first (0 .. gpus_per_rank − 1); `cpu` and `disk` allow offloading there (slow).
    """

    path: str | None = None
    revision: str | None = None
    gguf_file: str | None = None
    skip_layers: list[int] = field(default_factory=list)
    dtype: str = "float32"
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | dict[str, int | str] | None = None
    max_memory: dict[str, int | str] | None = None

    def describe(self) -> str:
        """A short human name for messages and summaries."""
        base = self.path or "target"
        if self.revision:
            base += f"@{self.revision}"
        if self.skip_layers:
            base += f" minus layers {format_layers(self.skip_layers)}"
        return base


def format_layers(layers: list[int]) -> str:
    """`[20, 21]` -> `20-21`; other lists comma-separated."""
    ordered = sorted(layers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 1:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))
