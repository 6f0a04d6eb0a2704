"""The `specheads export` configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ExportConfig:
    """What to export and where.

    Args:
        ckpt: a `.ckpt` (or run folder) from `specheads train`.
        out: the head folder to write (model.safetensors, config.json, README.md).
        report: an eval report folder (`specheads eval --out`): its tuned threshold, metrics and ROC plot go in.
        push_to_hub: a Hub repo id to upload the folder to (the token comes from HF_TOKEN or `hf auth login`).
        private: create the Hub repo private.
        revision: the branch to push to (created when missing).
        overwrite: replace an existing, non-empty `out`.
        weights_dtype: the dtype model.safetensors stores the weight matrices in (float16 halves the file; vectors
            and the input statistics stay float32); loading upcasts them into the head's float32.
        into_dspark: a DSpark drafter's folder (speculators' format): write a copy of it to `out` whose
            confidence_head.proj is this head (a dspark_confidence head), its calibration folded where engines apply
            it, every other tensor unchanged (docs/usage.md "Writing a head into a DSpark drafter").
    """

    ckpt: str
    out: str
    report: str | None = None
    push_to_hub: str | None = None
    private: bool = False
    revision: str | None = None
    overwrite: bool = False
    weights_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    into_dspark: str | None = None
