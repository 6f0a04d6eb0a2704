"""The feature drafters the round engine drafts with, by the option that names them (`--eagle3`, `--dspark`), loaded
from their folders as its draft: above `specheads.decoding.eagle3` and `specheads.decoding.dspark`, which each hold
one algorithm behind the face they share (`specheads.decoding.features.FeatureDraft`)."""

from __future__ import annotations

from pathlib import Path
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


def feature_drafter_of(draft: Any) -> tuple[str, str | None] | None:
    """(kind, folder) of a feature draft (`FeatureDraft`): its algorithm (`DRAFTER_KINDS`) and the folder its drafter
    was loaded from (`specheads.pair.drafter_checks.loaded_from`; None for one built in memory); None for any other
    draft."""
    if not isinstance(draft, FeatureDraft):
        return None
    folder = getattr(draft.drafter, "loaded_from", None)
    return draft.drafter.config.speculators_model_type, None if folder is None else str(folder)


def generate_draft_refusal(head_draft: dict[str, Any], draft: Any) -> str | None:
    """Why a head whose config.json records `head_draft` (its `draft`: name and the identity of the data's draft,
    `weights`) cannot score what `draft` drafts in `speculative_generate`, or None: `head_draft_refusal` where the
    draft is a feature drafter loaded from its folder, or a draft model; for a drafter built in memory, whose files
    are unknown, only a head trained on another kind of draft is refused."""
    name, identity = head_draft.get("name"), {"draft": head_draft.get("weights") or {}}
    kind, drafter = identity["draft"].get("kind"), feature_drafter_of(draft)
    if drafter is not None and drafter[1] is not None:
        return head_draft_refusal(name, identity, (drafter[0], drafter[1]))
    if kind == (drafter or (None,))[0]:
        return None
    drafting = "a draft model" if drafter is None else f"the {DRAFTER_KINDS[drafter[0]]} drafter built in memory"
    return (f"it read the state of {name or 'an unrecorded draft'}{f' (labelled by the {DRAFTER_KINDS[kind]} drafter)' if kind else ''}, "
            f"not of {drafting}; give a head trained on data this draft labelled")


def head_draft_refusal(head_draft: str | None, data_identity: dict[str, Any] | None, drafter: tuple[str, str] | None,
                       draft_name: str | None = None) -> str | None:
    """Why a head trained on data whose manifest names `head_draft` and records `data_identity` cannot score what a
    run drafts, or None when it can. `drafter` (kind, folder): the run drafts with that feature drafter, and the data
    must have been labelled by it (the same kind and files, `labelled_by_drafter`); None: it drafts with a draft model
    named `draft_name` (as `ModelSpec.describe` names it), and the data's draft must be that one."""
    from specheads.pair.drafters import labelled_by_drafter

    labelled = (data_identity or {}).get("draft") or {}
    if drafter is not None:
        kind, folder = drafter
        if not Path(folder).is_dir():
            return f"there is no {DRAFTER_KINDS[kind]} drafter folder at {folder}; give the folder the drafter was saved to"
        if labelled_by_drafter(labelled, kind, folder):
            return None
        return (f"it read the state of {head_draft or 'an unrecorded draft'}, not of the {DRAFTER_KINDS[kind]} drafter "
                f"in {folder} (another kind, or other files); give a head trained on data that drafter labelled")
    if not labelled.get("kind") and (draft_name is None or head_draft == draft_name):
        return None
    return (f"it read the state of {head_draft or 'an unrecorded draft'}, not of the draft model {draft_name} this run "
            f"drafts with; give a head trained on that draft's data, or the feature drafter's option")
