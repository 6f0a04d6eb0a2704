"""A token head fitted again on what a server logged, in process, as a serving loop retrains it between requests
(`specheads.train.lookup_loop`): every position the running rule reached in the logs trains (the survival likelihood
of `specheads.train.lookup_logs`, unobserved positions skipped), none is held out (a loop has no held-out prompts:
its head is the last epoch's, nothing is chosen on a validation split), from fresh weights or from a head's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from specheads.heads.lookup import TokenHeadModel
from specheads.lookup.token_head import CONFIG, TokenHead
from specheads.plumbing.batch_end_stops import StopAtBatchEnds
from specheads.plumbing.noise import third_party_quiet
from specheads.train.lookup import LookupHeadModule
from specheads.train.lookup_logs import LogDataModule


@dataclass(frozen=True)
class Recipe:
    """The head's shape (for a fresh head), its optimiser, epochs, batch and seed."""

    width: int = 64
    depth: int = 2
    lr: float = 3e-3
    weight_decay: float = 0.0
    max_epochs: int = 20
    batch_size: int = 512
    seed: int = 0

    @classmethod
    def of_config(cls, config: dict[str, Any]) -> Recipe:
        """The recipe of a `specheads train lookup` YAML (e.g. configs/train/lookup-stop.yaml), parsed."""
        model, trainer, data = config.get("model", {}), config.get("trainer", {}), config.get("data", {})
        fresh = cls()
        return cls(width=int(model.get("width", fresh.width)), depth=int(model.get("depth", fresh.depth)),
                   lr=float(model.get("lr", fresh.lr)), weight_decay=float(model.get("weight_decay", 0.0)),
                   max_epochs=int(trainer.get("max_epochs", fresh.max_epochs)),
                   batch_size=int(data.get("batch_size", fresh.batch_size)),
                   seed=int(data.get("split_seed", fresh.seed)))


class ServedLogs(LogDataModule):
    """Every reached position of the logs in the training split (the validation split the same positions: it only
    reports the fit)."""

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        tokens = {name: value for name, value in self.tokens().items() if name != "prompt_id"}
        self.splits = {"train": tokens, "val": tokens}


def refit(logs: list[str], folder: Path, recipe: Recipe, start: str | None = None) -> Path:
    """The head fitted on `logs` (module docstring) and exported to `folder` (model.safetensors, then config.json),
    from the weights and input statistics of the head folder `start`, or fresh (None); a folder that already holds
    a head is kept (the loop resumes)."""
    if (folder / CONFIG).is_file():
        return folder
    torch.manual_seed(recipe.seed)
    np.random.seed(recipe.seed)
    module = LookupHeadModule(width=recipe.width, depth=recipe.depth, lr=recipe.lr, weight_decay=recipe.weight_decay,
                              export=str(folder))
    if start is not None:
        module.head = TokenHeadModel.from_runtime(TokenHead.load(start, "lookup", target_state_size=0))
    with third_party_quiet():
        trainer = L.Trainer(max_epochs=recipe.max_epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(folder.parent),
                            callbacks=[StopAtBatchEnds()])
        trainer.fit(module, datamodule=ServedLogs(list(logs), "skip", batch_size=recipe.batch_size))
    return folder
