"""Which DSpark drafter a confidence head was trained on, checked before `export --into-dspark` writes it in.

The head reads the drafter's last state and Markov embedding, so it belongs to the drafter whose states labelled its
data: the data's manifest records that drafter's kind and the digest of its files (`drafter_weights_sha256`), and the
checkpoint carries the manifest's identity. A folder export wrote is that drafter with another confidence head (its
files differ): its provenance file names the drafter it came from and the digest of the folder as written
(`lineage_sha256`), so a head of that drafter goes into it again while nothing else in it has changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specheads.artifacts.checkpoint import TrainedHead
from specheads.plumbing.errors import UsageError

KIND = "dspark"


def lineage_sha256(folder: Path, provenance_file: str, cached: bool = True) -> str:
    """The digest of `folder`'s files as `drafter_weights_sha256` takes it, the provenance file's content left out
    (it records this digest); `cached`: through the file-facts cache (a folder that stays where it is)."""
    from specheads.pair.digests import cached_weights_sha256, weights_sha256
    from specheads.pair.models import ResolvedSource, local_weights_sha256

    digest = cached_weights_sha256 if cached else weights_sha256
    source = ResolvedSource(location=str(folder), revision=None, gguf_file=None, is_local=True)
    return local_weights_sha256(source, lambda path: "" if path.name == provenance_file else digest(path))


def inherited_sha256(folder: Path, provenance_file: str) -> str | None:
    """The drafter a folder export wrote came from (its files' digest), while the folder is as export wrote it; None
    for any other folder."""
    try:
        recorded = json.loads((folder / provenance_file).read_text(encoding="utf-8")).get("drafter") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(recorded, dict) or not recorded.get("weights_sha256") or not recorded.get("folder_sha256"):
        return None
    return recorded["weights_sha256"] if recorded["folder_sha256"] == lineage_sha256(folder, provenance_file) else None


def check_drafter(trained: TrainedHead, folder: Path, provenance_file: str) -> dict[str, Any]:
    """Refuse, in one line, a head not trained on the states of the DSpark drafter in `folder` (another drafter,
    a draft model such as the skip-layer draft, or no recorded drafter); returns the drafter it was trained on."""
    from specheads.pair.drafters import drafter_weights_sha256

    labelled = (trained.data_identity or {}).get("draft") or {}
    fix = f"train it on data `specheads gen --drafter.kind {KIND} --drafter.path {folder}` labelled"
    if not labelled:
        raise UsageError(f"{trained.source} records no drafter whose states labelled its data (trained before specheads "
                         f"recorded it?), so export cannot tell that it belongs to the drafter in {folder}; {fix}")
    if labelled.get("kind") != KIND:
        raise UsageError(f"{trained.source} read the states of {labelled.get('name') or trained.draft or 'a draft model'}, "
                         f"not of a DSpark drafter, and engines would feed it the drafter's in {folder}; {fix}")
    wanted = labelled.get("weights_sha256")
    found = drafter_weights_sha256(folder)
    if wanted != found and wanted != inherited_sha256(folder, provenance_file):
        raise UsageError(f"{trained.source} was trained on data labelled by the DSpark drafter {labelled.get('folder')} "
                         f"(files {wanted}), not by the DSpark drafter in {folder} (files {found}); {fix}")
    return {"kind": KIND, "folder": labelled.get("folder"), "weights_sha256": wanted}
