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


def head_draft_refusal(head_draft: str | None, kind: str | None) -> str | None:
    """Why a head whose checkpoint names `head_draft` (the draft of the data it trained on) cannot score what the
    `kind` feature drafter drafts (`kind` None: the pair's own draft model), or None when it can. Data a feature
    drafter labelled names it `<EAGLE-3|DSpark> <folder>` (gen's `ModelPair.draft_name`)."""
    read = next((name for name in DRAFTER_KINDS.values() if str(head_draft or "").startswith(f"{name} ")), None)
    wanted = None if kind is None else DRAFTER_KINDS[kind]
    if read == wanted:
        return None
    return (f"it read the state of {head_draft}, not of the {wanted or 'draft model'} this run drafts with; give a head "
            f"trained on data {'that drafter' if wanted else 'the draft model'} labelled")
