"""The draft model a labelled dataset was made with, loaded from its manifest (for online training)."""

from __future__ import annotations

from typing import Any

import torch

from specheads.pair.models import ModelSpec, derived_draft, load_model, load_pair


def load_draft(manifest: dict[str, Any]) -> torch.nn.Module:
    """The frozen draft named in `manifest` (a derived draft is rebuilt from its target); for data labelled with a
    feature drafter, the target, whose input embedding the drafter shares (what a head reading the candidate's
    embedding takes from the draft)."""
    config = manifest["config"]
    target, draft = ModelSpec(**config["target"]), ModelSpec(**config["draft"])
    if manifest["identity"]["draft"].get("kind"):
        return load_model(target)
    if derived_draft(draft):
        return load_pair(target, draft).draft
    return load_model(draft)
