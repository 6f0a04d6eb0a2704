"""A trained head with what it was trained on, from a Lightning checkpoint or an exported head folder.

Eval and export both start here (a core module: neither imports train). The checkpoint carries the head's weights and the run's
hyperparameters (data fingerprint and identity, split with its training prompts, τ). Nothing is ever
written back into it: the tuned decision rule lives in eval's report, which export reads.
"""

from __future__ import annotations

import pickle
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specheads.heads import AcceptanceHead, build_head
from specheads.heads.loading import COST_RULE, DecisionRule, load_head, read_head_config, resolve_folder, shipped_heads
from specheads.heads.roles import SIBLING, check_role, role_of
from specheads.plumbing.errors import UsageError


@dataclass
class TrainedHead:
    """A head plus the facts about its training that eval and export need."""

    head: AcceptanceHead
    source: str
    draft: str
    target: str | None
    data_fingerprint: str | None
    data_identity: dict[str, Any] | None
    sampling: dict[str, Any] | None
    tau: float = 1.0
    contexts: str = "consistent"
    split: dict[str, Any] = field(default_factory=lambda: {"val_fraction": 0.1, "split_seed": 0})
    decision: DecisionRule | None = None  # an exported head folder's tuned rule (a checkpoint carries none)
    evaluation: dict[str, Any] | None = None  # an exported head folder's headline metrics
    training: dict[str, Any] = field(default_factory=dict)  # the run's hyperparameters, for the model card

    @property
    def reads(self) -> str:
        """Which draft state the head reads."""
        return self.head.reads

    @property
    def purpose(self) -> str:
        """`stop` (a SpecDec++ stop head) or `verify` (a SPRINTER verifier)."""
        return self.head.purpose

    @property
    def role(self) -> str:
        """What the head was trained on, and so where a decoder may use it (`specheads.heads.roles`)."""
        return self.head.role

    @property
    def children(self) -> str:
        """Which children the head learned to score: `first` (drafted candidates) or `second` (a tree's second
        children, `data.children: second`: a `sibling` head)."""
        return "second" if self.role == SIBLING else "first"

    def check_role(self, allowed: Collection[str], where: str) -> None:
        """Refuse the head, in one line, unless its role is one of `allowed` for `where` (e.g. `--budget-head`)."""
        try:
            check_role(self.head, allowed, where)
        except UsageError as error:
            raise UsageError(f"{self.source}: {error}") from None

    @property
    def used_prompts(self) -> set[str] | None:
        """The prompts training used, to fit the head or its calibration (`specheads.dataset.prompts.prompt_digest` of their
        token ids): eval holds out every other prompt. None for a head trained before specheads recorded them."""
        recorded = self.split.get("train_prompts")
        return None if recorded is None else set(recorded) | set(self.split.get("calibration_prompts") or [])

    @property
    def rule(self) -> DecisionRule:
        """An exported folder's tuned decision rule, else the untuned default."""
        return self.decision or DecisionRule.untuned(self.purpose)


def unpickling_reason(error: Exception) -> str:
    """What torch's weights-only unpickler refused (`Unsupported global: GLOBAL builtins.exec`), without its advice
    to allowlist the object or to load the file with weights_only=False: both would run the file's code."""
    found = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
    found = found.split(" was not an allowed global")[0].split(". Please use")[0].removeprefix("WeightsUnpickler error: ")
    return found or "an object weights_only does not allow"


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The raw checkpoint dict, unpickled with `weights_only=True`: tensors, numbers, strings and plain containers
    only, so a downloaded file cannot run code. A one-line refusal for anything else."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UsageError(f"refused {path}: it pickles Python objects beyond tensors and plain containers "
                         f"({unpickling_reason(error)}), "
                         "which could run code when loaded; specheads loads checkpoints with torch.load(weights_only=True): "
                         "give a .ckpt from `specheads train` or a head folder from `specheads export`") from None
    except Exception as error:  # torch raises several types for a corrupt or foreign file
        raise UsageError(f"{path} is not a readable Lightning checkpoint ({type(error).__name__}); "
                         "give a .ckpt from `specheads train` or a head folder from `specheads export`") from None
    if not isinstance(checkpoint, dict):
        raise UsageError(f"{path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint; give a .ckpt from "
                         "`specheads train` or a head folder from `specheads export`")
    return checkpoint


def head_from_hyperparameters(hparams: dict[str, Any]) -> AcceptanceHead:
    """The head a training run's hyperparameters describe (`train.module.AcceptanceModule`'s `head`, `head_args`,
    `extra_features`, `hidden_size`, `embedding_size`), untrained, with the role they record (`role`; a run from
    before roles were recorded: the one its purpose and `data_split.children` imply)."""
    kwargs: dict[str, Any] = {"hidden_size": hparams["hidden_size"], "extra_features": list(hparams.get("extra_features") or []),
                              **(hparams.get("head_args") or {})}
    if hparams.get("embedding_size"):
        kwargs["candidate_embedding_size"] = hparams["embedding_size"]
    head = build_head(hparams.get("head", "specdecpp_resnet"), **kwargs)
    head.set_role(hparams.get("role") or role_of(head.purpose, (hparams.get("data_split") or {}).get("children", "first")))
    return head


def head_from_checkpoint(checkpoint: dict[str, Any], path: Path) -> AcceptanceHead:
    """The head a checkpoint describes, built from its hyperparameters (no instantiator or class path stored in the
    file is followed) with its weights loaded strictly."""
    head = head_from_hyperparameters(checkpoint.get("hyper_parameters") or {})
    weights = {key[len("head."):]: value for key, value in (checkpoint.get("state_dict") or {}).items()
               if key.startswith("head.")}
    result = head.load_state_dict(weights, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise UsageError(f"{path} does not fit the head its hyperparameters describe (missing "
                         f"{result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}); give the checkpoint as "
                         "`specheads train` wrote it")
    return head


def from_checkpoint(path: Path) -> TrainedHead:
    """The head and training facts stored in a `specheads train` checkpoint."""
    checkpoint = read_checkpoint(path)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    if "head" not in hparams or hparams.get("hidden_size") is None:
        raise UsageError(f"{path} is not a `specheads train` checkpoint (its hyperparameters name no head); "
                         "give a checkpoint from a specheads run folder")
    head = head_from_checkpoint(checkpoint, path)
    split = hparams.get("data_split") or {"val_fraction": 0.1, "split_seed": 0}
    return TrainedHead(
        head=head.eval(), source=str(path), draft=hparams.get("draft"), target=hparams.get("target"),
        data_fingerprint=hparams.get("data_fingerprint"), data_identity=hparams.get("data_identity"),
        sampling=hparams.get("data_sampling"), tau=float(hparams.get("tau", 1.0)),
        contexts=hparams.get("contexts", "consistent"), split=dict(split),
        training={k: v for k, v in hparams.items() if k not in ("data_identity",)},
    )


def from_folder(path: str) -> TrainedHead:
    """The head and training facts of an exported head folder (or Hub repo id)."""
    folder = resolve_folder(path)
    config = read_head_config(folder)
    head, rule = load_head(str(folder))
    data = config.get("training_data") or {}
    return TrainedHead(
        head=head, source=path, draft=(config.get("draft") or {}).get("name"),
        target=(config.get("target") or {}).get("name"), data_fingerprint=data.get("fingerprint"),
        data_identity=data.get("identity"), sampling=config.get("sampling"), tau=float(config.get("tau") or 1.0),
        contexts=config.get("contexts", "consistent"), split=data.get("split") or {"val_fraction": 0.1, "split_seed": 0},
        decision=rule if rule.tuned or rule.rule == COST_RULE else None, evaluation=config.get("metrics"),
        training=config.get("training") or {},
    )


def load_trained(path: str) -> TrainedHead:
    """A `.ckpt` from `specheads train`, a training run's folder (its last checkpoint), or a head folder / Hub repo id
    / shipped head's name from `specheads export` (a shipped head's name wins over a folder of that name, as in
    `load_head`)."""
    if not isinstance(path, str) or not path.strip() or path in shipped_heads():
        return from_folder(path)  # `resolve_folder` refuses an empty name and finds a shipped head
    candidate = Path(path).expanduser()
    if candidate.is_file():
        return from_checkpoint(candidate)
    if candidate.is_dir() and not (candidate / "config.json").exists():
        last = candidate / "checkpoints" / "last.ckpt"
        if last.is_file():  # a training run folder: its newest checkpoint
            return from_checkpoint(last)
    return from_folder(path)
