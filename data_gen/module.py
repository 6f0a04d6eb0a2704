"""Labelling as a Lightning predict loop: one process per device, each writing its own shards.

`Trainer.predict` gives the same code path on 1 CPU process, N GPUs, or several nodes under
torchrun/SLURM. Shards are split over ranks by index; a shard that exists and verifies against its
record (this run's, its sha256 intact) is skipped, so a killed run started again finishes the rest and
nothing is labelled twice, while a shard of another run or one changed on disk is labelled again.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader

from specheads.data_gen.drafter_labels import FeatureDrafter, label_drafter_batch
from specheads.data_gen.engines import BuiltinEngine
from specheads.data_gen.labels import label_batch
from specheads.data_gen.onepass import OnePass, ProbeFailed, derived_layout
from specheads.data_gen.plan import Shard
from specheads.dataset.shards import shard_problem
from specheads.dataset.storage import DEFAULT_STORAGE, FeatureStorage
from specheads.dataset.store import DrafterColumns, row_features, write_shard
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.models import stop_token_ids


class LabellingModule(L.LightningModule):
    """Generates (or takes imported) responses and labels them, one shard per predict step."""

    def __init__(self, target: Any, draft: Any, tokenizer: Any, shards: list[Shard], out: Path,
                 transform: SamplingTransform, max_new_tokens: int, seed: int, chunk: int, store_features: bool,
                 state_layer: int | None, run: str, storage: FeatureStorage = DEFAULT_STORAGE,
                 engine: BuiltinEngine | None = None, target_states: bool = False, siblings: bool = False,
                 threads: int | None = None):
        super().__init__()
        # Out of the module tree: Lightning would move (and under DDP broadcast) registered models whole, undoing a
        # target spread over the rank's GPUs. load_pair has put both on this rank's devices (data_gen.placement).
        self._models = {"target": target, "draft": draft}
        self.tokenizer = tokenizer
        self.shards = shards
        self.out = out
        self.transform = transform
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.chunk = chunk
        self.store_features = store_features
        self.state_layer = state_layer
        self.run = run  # the data fingerprint: a shard another run wrote is labelled again
        self.storage = storage
        self.target_states = target_states
        self.siblings = siblings
        self.threads = threads  # torch threads this rank labels with (None: as they are)
        self.engine = engine or BuiltinEngine(tokenizer, transform, max_new_tokens, seed)  # responses not imported
        self._labellers: dict[str, OnePass | None] = {}

    @property
    def target(self) -> Any:
        """The target model, where load_pair placed it."""
        return self._models["target"]

    @property
    def draft(self) -> Any:
        """The draft model, where load_pair placed it."""
        return self._models["draft"]

    def on_predict_start(self) -> None:
        """Set this rank's torch threads: here, after Lightning's launcher has set its own (cores / ranks)."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)

    def predict_dataloader(self) -> DataLoader:
        """This rank's shards: every world_size-th one, starting at its global rank. A rank left without a shard
        (a small job on many devices) takes one empty step, so that it still joins the collective end of the run."""
        mine: list[Shard | None] = list(self.shards[self.global_rank :: self.trainer.world_size]) or [None]
        return DataLoader(mine, batch_size=None, collate_fn=_identity, shuffle=False)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # a shard is a plan; tensors are built on the device inside the step

    def one_pass(self) -> OnePass | None:
        """The one-pass labeller (data_gen.onepass), built on first use, where it serves: a CPU, a draft derived from the
        target, generated responses with the default generation settings (no static cache, no compiled step), no target
        states. None elsewhere: responses from `generate` (or imported), then `label_batch`."""
        if "one_pass" not in self._labellers and isinstance(self.draft, FeatureDrafter):
            self._labellers["one_pass"] = None
        if "one_pass" not in self._labellers:
            options = self.engine.options
            fits = (self.device.type == "cpu" and options.cache == "dynamic" and not options.compile
                    and not self.target_states)
            labeller, why = None, None
            if fits:
                try:
                    labeller = OnePass.build(self.target, self.draft, self.state_layer, self.store_features)
                except ProbeFailed as failure:
                    why = str(failure)
                if labeller is None and why is None and derived_layout(self.target, self.draft, None):
                    why = "its attention is not one the pass computes"
            if why and self.global_rank == 0:
                print(f"specheads gen: the one-pass labeller cannot run {type(self.target).__name__} ({why}); "
                      "labelling with generate and teacher-forced forwards instead (slower)", file=sys.stderr)
            self._labellers["one_pass"] = labeller
        return self._labellers["one_pass"]

    def predict_step(self, shard: Shard | None, batch_idx: int) -> tuple[Shard | None, dict[str, list] | None]:
        if shard is None or shard_problem(self.out, shard.index, self.run, None, deep=True) is None:
            return shard, None  # nothing to do here, or done and verified (sha256 included)
        columns: dict[str, list] = {}
        rows = [item for items in shard.batches for item in items]
        if all(item.response_ids is None for item in rows) and self.one_pass() is not None:
            rows_per_pass = self.engine.options.batch_size
            return shard, self.one_pass().run(
                rows, self.transform, self.max_new_tokens, self.seed, stop_token_ids(self.target, self.tokenizer),
                self.store_features, self.storage, self.siblings, rows_per_pass if isinstance(rows_per_pass, int) else None)
        responses = iter(self.engine.responses(self.target, rows, self.device, len(shard.batches[0])))
        for items in shard.batches:
            batch = self.label_batch(items, [next(responses) for _ in items])
            for name, values in batch.items():
                columns.setdefault(name, []).extend(values)
        return shard, columns

    def label_batch(self, items: list[Any], responses: list[list[int]]) -> dict[str, list]:
        """The columns of one batch of rows: `label_batch`, or with a feature drafter as the draft
        `label_drafter_batch`."""
        if isinstance(self.draft, FeatureDrafter):
            return label_drafter_batch(self.target, self.draft, items, responses, self.transform, self.seed,
                                       self.tokenizer.pad_token_id, self.device, self.storage, self.siblings)
        return label_batch(self.target, self.draft, items, responses, self.transform, self.seed,
                           self.tokenizer.pad_token_id, self.chunk, self.store_features, self.device,
                           self.state_layer, self.storage, self.target_states, self.siblings)


def _identity(item: Any) -> Any:
    return item


class ShardWriter(BasePredictionWriter):
    """Writes each finished shard atomically; when every rank is done, rank 0 runs `on_complete`."""

    def __init__(self, out: Path, hidden_size: int | None, on_complete: Callable[[int, float], None], run: str,
                 features_dtype: str = "float16", target_hidden_size: int | None = None, siblings: bool = False,
                 drafter: DrafterColumns | None = None):
        super().__init__(write_interval="batch")
        self.out = out
        self.run = run
        self.schema = row_features(hidden_size, features_dtype, target_hidden_size, siblings, drafter)
        self.on_complete = on_complete
        self.tokens_written = 0
        self.started = time.perf_counter()

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        shard, columns = prediction
        if columns is not None:
            write_shard(self.out, shard.index, columns, self.schema, self.run)
            self.tokens_written += sum(len(ids) for ids in columns["target_ids"])

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        written = trainer.strategy.reduce(torch.tensor(float(self.tokens_written), device=pl_module.device), reduce_op="sum")
        trainer.strategy.barrier("specheads-gen-shards-written")
        if trainer.is_global_zero:
            self.on_complete(int(written.item()), time.perf_counter() - self.started)
        trainer.strategy.barrier("specheads-gen-finalised")
