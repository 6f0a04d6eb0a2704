"""The feature drafters the round engine drafts with, by the option that names them (`--eagle3`, `--dspark`), loaded
from their folders as its draft: above `specheads.decoding.eagle3` and `specheads.decoding.dspark`, which each hold
one algorithm behind the face they share (`specheads.decoding.features.FeatureDraft`)."""

from __future__ import annotations

from typing import Any

from specheads.decoding.features import FeatureDraft

DRAFTER_KINDS = {"eagle3": "EAGLE-3", "dspark": "DSpark"}
"""The feature drafters the round engine drafts with, by the option that names them, and their names in words."""


def load_feature_draft(kind: str, folder: str, target: Any) -> FeatureDraft:
    """The drafter of `kind` (`DRAFTER_KINDS`) saved in `folder` (speculators' format) as the round engine's draft
    over `target`; a folder it cannot draft with is refused in one line."""
    if kind == "eagle3":
        from specheads.decoding.eagle3 import Eagle3Model
        from specheads.pair.eagle3 import load_drafter

        return Eagle3Model(load_drafter(folder, target), target)
    from specheads.decoding.dspark import DSparkModel
    from specheads.pair.dspark import load_drafter as load_dspark

    return DSparkModel(load_dspark(folder, target), target)
