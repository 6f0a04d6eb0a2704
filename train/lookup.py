"""`specheads train lookup fit`: a token-only head of free drafts trained on lookup labels (`specheads gen
--drafter.kind lookup|suffix`), with the recipe's LightningCLI (`train.cli`).

The stop head (`lookup_token_stop`) learns the conditional acceptance â_k = P(x_k accepted | x_<k accepted): its
loss at a proposed token is the BCE against the label p(x_k | context, x_<k), weighted by the chance that a decode
reaches k (the product of the earlier labels: 1 or 0 at T = 0). The expected head (`lookup_token_expected`) learns
the survival s_k = P(x_1..x_k accepted) at every proposed token, against the product of the labels up to k. Either
head may also read the target's state at the last verified position (`target_state: true`; data from
`--target-states true`). At the end of the fit the head is exported where the runtime loads it
(`<default_root_dir>/head`: model.safetensors + config.json).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from specheads.artifacts.metrics import binary_kl, expected_calibration_error, soft_auc
from specheads.dataset.datamodule import prompt_split
from specheads.dataset.lookup import flat_tokens, load_lookup, proposal_products  # noqa: F401  (names train reads)
from specheads.dataset.store import read_manifest
from specheads.heads.lookup import TokenHeadModel
from specheads.lookup.token_head import EXPECTED, HEAD_TYPES
from specheads.plumbing.errors import UsageError


class LookupDataModule(L.LightningDataModule):
    """Lookup labels split by prompt (the split of `AcceptanceDataModule`: `val_fraction` of the prompts by a seeded
    hash), as flat token tensors.

    Args:
        path: the folder `specheads gen --drafter.kind lookup|suffix` wrote.
        val_fraction: the share of prompts held out for validation.
        split_seed: the seed of the split by prompt.
        batch_size: proposed tokens per training step.
        target_state: also load the target's state at the last verified position (data from --target-states true).
    """

    def __init__(self, path: str, val_fraction: float = 0.1, split_seed: int = 0, batch_size: int = 512,
                 target_state: bool = False) -> None:
        super().__init__()
        if not 0 < val_fraction < 1 or batch_size < 1:
            raise UsageError(f"data.val_fraction must be in (0, 1) and data.batch_size >= 1, got {val_fraction}, {batch_size}")
        self.path, self.val_fraction, self.split_seed = path, val_fraction, split_seed
        self.batch_size, self.target_state = batch_size, target_state
        self.splits: dict[str, dict[str, np.ndarray]] = {}

    @property
    def manifest(self) -> dict[str, Any]:
        """The dataset's manifest."""
        return read_manifest(Path(self.path)) or {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        rows = load_lookup(self.path)
        identity = self.manifest["identity"]
        if self.target_state and not identity.get("target_states"):
            raise UsageError(f"{self.path} holds no target states; label it with --target-states true, or set "
                             "data.target_state false")
        tokens = flat_tokens(rows, self.target_state)
        split = np.array([prompt_split(p, self.split_seed, self.val_fraction) for p in rows["prompt_id"]])[tokens["row"]]
        self.splits = {name: {key: value[split == name] for key, value in tokens.items()} for name in ("train", "val")}
        if not len(self.splits["train"]["label"]) or not len(self.splits["val"]["label"]):
            raise UsageError(f"the split of {self.path} by prompt leaves a side without tokens; label more prompts or "
                             "change data.val_fraction")

    def loader(self, split: str, shuffle: bool) -> DataLoader:
        """Batches of (features, label, reach, survival[, target_state])."""
        tokens = self.splits[split]
        names = ["features", "label", "reach", "survival", *(["target_state"] if self.target_state else [])]
        dataset = TensorDataset(*(torch.as_tensor(tokens[name], dtype=torch.float32) for name in names))
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle,
                          generator=torch.Generator().manual_seed(self.split_seed) if shuffle else None)

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("val", shuffle=False)


class LookupHeadModule(L.LightningModule):
    """A token-only head and its loss (module docstring).

    Args:
        head: `lookup_token_stop` (conditional â_k) or `lookup_token_expected` (survival s_k).
        width, depth: the head's input layer width and residual blocks.
        target_state: also read the target's state at the last verified position (set data.target_state too).
        lr, weight_decay: AdamW's.
        export: where the fitted head is written (default `<trainer.default_root_dir>/head`).
    """

    def __init__(self, head: str = "lookup_token_stop", width: int = 64, depth: int = 2, target_state: bool = False,
                 lr: float = 3e-3, weight_decay: float = 0.0, export: str | None = None) -> None:
        super().__init__()
        if head not in HEAD_TYPES:
            raise UsageError(f"model.head {head!r} is not a token head; give one of {', '.join(HEAD_TYPES)}")
        self.save_hyperparameters()
        self.head: TokenHeadModel | None = None
        self.outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule
        data.setup(stage)
        if self.hparams.target_state != data.target_state:
            raise UsageError("model.target_state and data.target_state differ; set both true or both false")
        if self.head is not None:
            return
        identity = data.manifest["identity"]
        size = int(identity.get("target_hidden_size", 0)) if self.hparams.target_state else 0
        self.head = TokenHeadModel(self.hparams.head, self.hparams.width, self.hparams.depth, size,
                                   identity["draft"]["kind"])
        train = data.splits["train"]
        states = torch.as_tensor(train["target_state"]) if size else None
        self.head.set_statistics(torch.as_tensor(train["features"]), states)

    def label_and_weight(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's target and each token's weight: survival and 1 (expected head), label and reach (stop head)."""
        _, label, reach, survival = batch[:4]
        if self.hparams.head == EXPECTED:
            return survival, torch.ones_like(survival)
        return label, reach

    def logits(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self.head(batch[0], batch[4] if self.hparams.target_state else None)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        target, weight = self.label_and_weight(batch)
        losses = torch.nn.functional.binary_cross_entropy_with_logits(self.logits(batch), target, reduction="none")
        loss = (losses * weight).sum() / weight.sum().clamp_min(1e-6)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        target, weight = self.label_and_weight(batch)
        self.outputs.append((torch.sigmoid(self.logits(batch)).detach(), target, weight))

    def on_validation_epoch_end(self) -> None:
        if not self.outputs:
            return
        prediction, target, weight = (torch.cat(parts).double().numpy() for parts in zip(*self.outputs))
        self.outputs.clear()
        kept = weight > 0
        self.log("val/binary_kl", binary_kl(target[kept], prediction[kept], weight[kept]))
        self.log("val/auc", soft_auc(target[kept], prediction[kept], weight[kept]))
        self.log("val/ece", expected_calibration_error(target[kept], prediction[kept], weights=weight[kept]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def on_fit_end(self) -> None:
        if self.trainer.is_global_zero and self.head is not None:
            folder = Path(self.hparams.export or Path(self.trainer.default_root_dir) / "head")
            data = self.trainer.datamodule
            self.head.export(folder, training_data={"path": str(data.path), "fingerprint": data.manifest["fingerprint"],
                                                    "sampling": data.manifest["identity"]["sampling"],
                                                    "draft": data.manifest["identity"]["draft"],
                                                    "val_fraction": data.val_fraction, "split_seed": data.split_seed})
