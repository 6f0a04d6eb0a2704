"""`load_head`: an exported head folder or Hub repo -> a ready module and its decision rule, safely.

Only `model.safetensors` is ever read (a folder with pickled weights is refused), no remote code runs,
the config's hidden size is checked against the weights before anything is built, and the draft the
caller is about to use can be checked against the one the head was trained for.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from specheads.errors import UsageError
from specheads.heads.base import AcceptanceHead
from specheads.heads.registry import head_class
from specheads.hub import hub_unreachable, reach_fix

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
STOP_RULE = "stop_drafting_when_rejection_risk_above"
VERIFY_RULE = "call_target_when_acceptance_below"


@dataclass(frozen=True)
class DecisionRule:
    """How a decoder acts on the head's acceptance probabilities â.

    `stop_drafting_when_rejection_risk_above` (SpecDec++ stop heads): end the round once 1 − Π â_j over the
    round's scored candidates exceeds `threshold`, or at `max_draft` candidates (an `at_draft` head has scored
    the candidate just drafted, a `one_step_late` head the ones before it; docs/decoding-core.md).
    `call_target_when_acceptance_below` (SPRINTER verifiers): send the drafted token to the target
    when its â is below `threshold`; otherwise keep it unverified.
    """

    rule: str
    threshold: float
    tuned: bool
    max_draft: int | None = None
    cost_ratio: float | None = None  # the t_draft/t_target the threshold was tuned for

    @classmethod
    def untuned(cls, purpose: str) -> DecisionRule:
        """The default rule for a head of `purpose` (`stop`, `expect` or `verify`), marked untuned."""
        if purpose != "verify":
            return cls(STOP_RULE, 0.5, tuned=False, max_draft=8)
        return cls(VERIFY_RULE, 0.5, tuned=False)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for config.json."""
        return asdict(self)


def resolve_folder(path_or_repo_id: str, revision: str | None = None) -> Path:
    """A local folder as given, or the safetensors + config files of a Hub repo downloaded to the cache."""
    folder = Path(path_or_repo_id)
    if folder.is_dir():
        return folder
    if folder.exists() or path_or_repo_id.count("/") != 1 or path_or_repo_id.startswith((".", "/")):
        raise UsageError(f"{path_or_repo_id} is neither a head folder nor a Hub repo id (owner/name); "
                         "give the folder `specheads export --out` wrote or its repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    offline = hub_unreachable()  # decided at once: without a network the Hub client retries for minutes
    try:
        local = snapshot_download(repo_id=path_or_repo_id, revision=revision, local_files_only=offline is not None,
                                  allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, "README.md"])
    except (HfHubHTTPError, OSError, ValueError) as error:
        if offline:
            raise UsageError(f"cannot load head {path_or_repo_id!r}: it is not a local folder nor in the Hugging Face "
                             f"cache, and the Hub cannot be used ({offline}); {reach_fix()}, or give the head's "
                             "folder") from None
        raise UsageError(f"cannot download head {path_or_repo_id!r} (revision {revision or 'main'}): "
                         f"{str(error).splitlines()[0]}; check the repo id, the revision and your token") from error
    return Path(local)


def read_head_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json after the file checks (safetensors present, no pickled weights)."""
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED_SUFFIXES)
    if pickled:
        raise UsageError(f"{folder} holds pickled weights ({', '.join(pickled)}), which can run code when loaded; "
                         f"only {WEIGHTS_FILE} is loaded: re-export the head with `specheads export`")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise UsageError(f"{folder} has no {name}; a head folder holds {CONFIG_FILE} and {WEIGHTS_FILE} "
                             "(write one with `specheads export`)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as error:
        raise UsageError(f"{folder / CONFIG_FILE} is not valid JSON ({error}); re-export the head") from None
    if not isinstance(config, dict) or "head_type" not in config:
        raise UsageError(f"{folder / CONFIG_FILE} names no head_type; it is not a specheads head config")
    return config


def check_weights_shape(folder: Path, config: dict[str, Any]) -> None:
    """Refuse weights whose hidden size differs from the config's (read from the safetensors header)."""
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as weights:
            names = set(weights.keys())
            found = weights.get_slice("hidden_mean").get_shape()[0] if "hidden_mean" in names else None
    except Exception as error:  # safetensors raises SafetensorError (and others) on a file that is not its format
        raise UsageError(f"{folder / WEIGHTS_FILE} is not a safetensors file ({' '.join(str(error).split())[:120]}); "
                         "re-export the head with `specheads export`") from None
    if found is None:
        raise UsageError(f"{folder / WEIGHTS_FILE} holds no specheads head (no hidden_mean tensor)")
    if found != config.get("hidden_size"):
        raise UsageError(f"{folder}: config.json says hidden_size {config.get('hidden_size')} but the weights were "
                         f"made for hidden size {found}; the files do not belong together, re-export the head")


def flattened(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as dotted keys (`weights.spec.skip_layers`)."""
    if not isinstance(value, dict):
        return {prefix: value}
    items: dict[str, Any] = {}
    for key, inner in value.items():
        items.update(flattened(inner, f"{prefix}.{key}" if prefix else str(key)))
    return items


def draft_differences(trained_for: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The parts of the `expected` draft identity (`specheads.models.draft_identity`: name, weights, state layer) that
    the head's config.json records otherwise, each said with both values."""
    recorded = flattened(trained_for)
    return [f"{key} ({recorded.get(key)!r} here, {value!r} expected)"
            for key, value in flattened(expected).items() if recorded.get(key) != value]


def load_head(path_or_repo_id: str, revision: str | None = None,
              expect_draft: str | dict[str, Any] | None = None) -> tuple[AcceptanceHead, DecisionRule]:
    """A ready head (eval mode) and its decision rule from a head folder or a Hub repo id.

    The head carries `trained_for` (the draft, the sampling transform and the purpose its config.json records), which
    a decoder checks against its own. `expect_draft` is the draft the caller will feed the head: its identity as export records it
    (`specheads.models.draft_identity(spec, model, state_layer)`: name, weights, state layer), or its name alone. A
    head trained for another draft is refused naming the part that differs: two self-speculative drafts of different
    targets share a name but not their weights.
    """
    folder = resolve_folder(path_or_repo_id, revision)
    config = read_head_config(folder)
    cls = head_class(config["head_type"])
    check_weights_shape(folder, config)
    trained_for = {**(config.get("draft") or {}), "state_layer": config.get("state_layer"),
                   "target_weights": (config.get("target") or {}).get("weights")}
    expected = {"name": expect_draft} if isinstance(expect_draft, str) else expect_draft
    differs = draft_differences(trained_for, expected) if expected is not None else []
    if differs:
        raise UsageError(f"head {path_or_repo_id} was trained for another draft: it differs in {'; '.join(differs)}; "
                         "use a head trained for your draft, or train one")
    try:
        head = cls.from_pretrained(str(folder))
    except (RuntimeError, TypeError, ValueError) as error:  # torch's load_state_dict: missing or unexpected keys
        reason = " ".join(str(error).split())[:200]
        raise UsageError(f"{folder}: the weights do not fit config.json (depth {config.get('depth')}): {reason}; the "
                         "files do not belong together, re-export the head") from None
    head.eval()
    head.trained_for = {"draft": trained_for, "sampling": config.get("sampling"), "purpose": cls.purpose}
    rule = config.get("decision_rule")
    return head, (DecisionRule(**rule) if rule else DecisionRule.untuned(cls.purpose))
