"""`AcceptanceDataModule`: batches of rows from a `specheads gen` folder, split by prompt.

offline mode reads the stored draft `features` (memory-mapped Arrow; rows are read when batched);
online mode has no stored features: the batch carries prompt + mixed token ids and the training
module computes the draft's states itself. Batches are rows grouped by length (less padding); each
rank takes its own slice of every global batch, so the same code runs on 1 process or N.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import datasets
import lightning as L
import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers.trainer_pt_utils import LengthGroupedSampler

from specheads.dataset.prompts import prompt_digest
from specheads.dataset.storage import as_tensor, kept_rows, require_states, storage_of
from specheads.dataset.store import load_labelled, read_manifest
from specheads.heads.base import with_derived_signals
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic

PER_POSITION_FLOATS = ("accept", "beta", "logp", "logq", "entropy", "top1")
SMALL_COLUMNS = ("prompt_id", "prompt_ids", "mixed_ids", "draft_ids", "is_draft", *PER_POSITION_FLOATS)
OPTIONAL_FLOATS = ("top2", "drafter_score")
"""Per-position columns a batch carries where the data has them (`top2`: datasets of labeller 3 on; `drafter_score`:
a DSpark drafter's confidence, `data_gen.drafter_labels`)."""
OPTIONAL_INTS = ("depth",)
"""Per-position integer columns a batch carries where the data has them (`depth`: a feature drafter's data)."""
KEPT_STATES = ("features", "markov_features")
"""State columns that keep the rows `features_at` names (`target_features` keeps them all)."""
SECOND_CHILD_COLUMNS = {"draft_ids": "sibling_ids", "accept": "sibling_accept", "beta": "sibling_beta",
                        "logq": "sibling_logq"}
"""With `children: second`, the columns a batch takes from the second-child labels (`gen --sibling_labels true`)."""
CHILDREN = ("first", "second")


def prompt_draw(prompt_id: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, prompt id): the split by prompt, whatever the row order or count."""
    digest = hashlib.sha256(f"{seed}\x00{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def is_validation_prompt(prompt_id: str, seed: int, fraction: float) -> bool:
    """Whether the prompt falls in the validation share `fraction` of the split by prompt."""
    return prompt_draw(prompt_id, seed) < fraction


def prompt_split(prompt_id: str, seed: int, val_fraction: float, calibration_fraction: float = 0.0) -> str:
    """"val" (the first `val_fraction` of the draws), "calibration" (the next `calibration_fraction`) or "train"."""
    draw = prompt_draw(prompt_id, seed)
    return "val" if draw < val_fraction else "calibration" if draw < val_fraction + calibration_fraction else "train"


def second_children(columns: dict[str, Any]) -> dict[str, Any]:
    """A row's (or a padded batch's) columns as a tree's second children: the candidate, its signal and labels are the
    second child's (`SECOND_CHILD_COLUMNS`), `first_accept` keeps the drafted candidate's acceptance, and
    `child_weight` = 1 − it is how often a tree checks the second child there (only once the first was rejected).
    Positions without a second child (−1: q had no other token) are marked in `has_second`."""
    second = np.asarray(columns["sibling_ids"])
    remapped = {name: columns[source] for name, source in SECOND_CHILD_COLUMNS.items()}
    remapped["draft_ids"] = np.maximum(second, 0)
    first = np.asarray(columns["accept"], dtype=np.float32)
    return {**columns, **remapped, "first_accept": first, "child_weight": 1.0 - first, "has_second": second >= 0}


class RowDataset(Dataset):
    """Rows of a labelled dataset as numpy dicts; `features` ([kept positions, hidden], float16 or bfloat16's uint16
    bits) only in offline mode, with `state_rows` (which of the n + 1 positions they are) when the data keeps only
    some (`features_at`, `data_gen.storage`).

    A batch is read in one go (`__getitems__`, which torch's DataLoader calls with a batch's indices): one
    Arrow take per batch instead of one per row, and the states stay views of the taken table."""

    def __init__(self, rows: datasets.Dataset, with_features: bool, features_at: str = "all",
                 with_target_states: bool = False, children: str = "first", with_markov: bool = False):
        self.columns = (SMALL_COLUMNS + tuple(name for name in (*OPTIONAL_FLOATS, *OPTIONAL_INTS) if name in rows.column_names)
                        + (tuple(SECOND_CHILD_COLUMNS.values()) if children == "second" else ()))
        self.children = children
        self.rows = rows.with_format("numpy", columns=list(self.columns))
        self.state_columns = (["features", *(["target_features"] if with_target_states else []),
                               *(["markov_features"] if with_markov else [])] if with_features else [])
        self.features = rows.with_format("arrow", columns=self.state_columns) if with_features else None
        self.features_at = features_at

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        indices = [int(i) for i in indices]
        columns = self.rows[indices]
        rows = [{name: columns[name][i] for name in self.columns} for i in range(len(indices))]
        if self.children == "second":
            rows = [second_children(row) for row in rows]
        if self.features is not None:
            table = self.features[indices]  # one take for every state column
            for name in self.state_columns:
                for row, states in zip(rows, feature_rows(table, name)):
                    row[name] = states
            if self.features_at != "all":
                for row in rows:
                    row["state_rows"] = kept_rows(row["is_draft"], self.features_at)
        return rows


def feature_rows(table: pa.Table, name: str = "features") -> list[np.ndarray]:
    """Each row's [positions, hidden] states from an Arrow table holding the `features` column (or `name`, an Array2D
    too); a row that kept no state gets [0, hidden]."""
    column = table.column(name)
    storage = column.combine_chunks().storage  # list<list<halffloat or uint16>>: rows, positions, hidden
    lengths = np.diff(storage.offsets.to_numpy())
    values = storage.flatten().flatten().to_numpy(zero_copy_only=False).reshape(-1, column.type.shape[-1])
    return np.split(values, np.cumsum(lengths)[:-1])


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Pad per-position columns to the longest response; `valid` marks real positions (of second children, those that
    have one: `second_children`); derived signals added."""
    width = max(len(row["accept"]) for row in rows)
    floats = (PER_POSITION_FLOATS + tuple(name for name in OPTIONAL_FLOATS if name in rows[0])
              + (("first_accept", "child_weight") if "child_weight" in rows[0] else ()))
    ints = ("draft_ids", *(name for name in OPTIONAL_INTS if name in rows[0]))
    padded = {"valid": np.zeros((len(rows), width), dtype=bool), "is_draft": np.zeros((len(rows), width), dtype=bool),
              **{name: np.zeros((len(rows), width), dtype=np.int64) for name in ints},
              **{name: np.zeros((len(rows), width), dtype=np.float32) for name in floats}}
    for index, row in enumerate(rows):
        n = len(row["accept"])
        padded["valid"][index, :n] = row.get("has_second", True)
        for name in ("is_draft", *ints, *floats):
            padded[name][index, :n] = row[name]
    if "features" in rows[0]:
        padded.update(padded_states(rows, width))
    for name in ("target_features", "markov_features"):
        if name in rows[0]:
            padded[name] = padded_states(rows, width, name)[name]
    batch: dict[str, Any] = {name: torch.from_numpy(values) for name, values in padded.items()}
    for name in ("features", "target_features", "markov_features"):
        if name in batch:
            batch[name] = as_tensor(padded[name])  # bfloat16 travels as its uint16 bits until here
    if "features" not in rows[0]:
        batch["prompt_ids"] = [row["prompt_ids"].tolist() for row in rows]
        batch["mixed_ids"] = [row["mixed_ids"].tolist() for row in rows]
    return with_derived_signals(batch)


def padded_states(rows: list[dict[str, Any]], width: int, name: str = "features") -> dict[str, np.ndarray]:
    """`features` (or `name`) [B, width + 1, hidden], each row's states at their positions (zero elsewhere), and, when
    the rows keep only some positions (`state_rows`), `state_kept` [B, width + 1] marking them."""
    hidden = rows[0][name].shape[-1]
    features = np.zeros((len(rows), width + 1, hidden), dtype=rows[0][name].dtype)
    if "state_rows" not in rows[0] or name not in KEPT_STATES:
        for index, row in enumerate(rows):
            features[index, : len(row[name])] = row[name]
        return {name: features}
    kept = np.zeros((len(rows), width + 1), dtype=bool)
    for index, row in enumerate(rows):
        features[index, row["state_rows"]] = row[name]
        kept[index, row["state_rows"]] = True
    return {name: features, "state_kept": kept}


class RankBatchSampler(Sampler[list[int]]):
    """Rows grouped by length into global batches of `batch_size × world_size`; rank r takes slice r.

    Training batches are shuffled per epoch (`set_epoch`) and cut to a whole number of global
    batches, so every rank runs the same number of steps; validation keeps every row.
    """

    def __init__(self, lengths: list[int], batch_size: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1):
        self.lengths = lengths
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return sorted(range(len(self.lengths)), key=lambda i: (-self.lengths[i], i))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return list(LengthGroupedSampler(self.batch_size * self.world_size, lengths=self.lengths, generator=generator))

    def _batches(self) -> list[list[int]]:
        order = self._order()
        step = self.batch_size * self.world_size
        if self.shuffle:
            order = order[: len(order) - len(order) % step] if len(order) >= step else []
        mine = []
        for start in range(0, len(order), step):
            chunk = order[start : start + step]
            share = -(-len(chunk) // self.world_size)
            batch = chunk[self.rank * share : (self.rank + 1) * share]
            if batch:
                mine.append(batch)
        return mine

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


class AcceptanceDataModule(L.LightningDataModule):
    """A `specheads gen` folder, split by prompt into train, validation and (when asked) calibration.

    Args:
        path: the folder `specheads gen --out` wrote.
        mode: `offline` reads stored features, `online` computes them with the frozen draft, `auto` picks
            offline when the dataset stores features.
        val_fraction: share of prompts held out for validation (never seen in training).
        calibration_fraction: share of prompts held out to fit a stop head's per-position calibration
            (`model.calibrate_positions`); neither trained nor validated on, and not reported by eval.
        split_seed: seed of the prompt split.
        batch_size: rows per batch and process (SpecDec++: 32).
        num_workers: DataLoader workers.
        train_rows: train on this many rows of the training split (a seeded choice; each smaller subset lies inside
            every larger one), for learning curves; the validation and calibration prompts stay the same. Null: all.
        children: `first`, the drafted candidates (a chain's, a tree's first children); `second`, a tree's second
            children (data labelled with `specheads gen --sibling_labels true`): the candidate, its signals and labels
            are the second child's and each position weighs 1 − the first child's acceptance, how often a tree checks
            a second child there (`second_children`). A head trained so scores a tree's second children.
    """

    def __init__(self, path: str, mode: Literal["auto", "offline", "online"] = "auto", val_fraction: float = 0.1,
                 split_seed: int = 0, batch_size: int = 32, num_workers: int = 0, calibration_fraction: float = 0.0,
                 train_rows: int | None = None, children: Literal["first", "second"] = "first"):
        super().__init__()
        if not 0 < val_fraction < 1:
            raise UsageError(f"data.val_fraction must lie in (0, 1), got {val_fraction}")
        if not 0 <= calibration_fraction < 1 - val_fraction:
            raise UsageError(f"data.calibration_fraction must lie in [0, 1 - data.val_fraction) = [0, {1 - val_fraction:g}), "
                             f"got {calibration_fraction}; the rest of the prompts train the head")
        if batch_size < 1:
            raise UsageError(f"data.batch_size must be at least 1, got {batch_size}")
        if train_rows is not None and train_rows < 1:
            raise UsageError(f"data.train_rows must be at least 1 (or null for the whole training split), got {train_rows}")
        manifest = read_manifest(Path(path))
        if manifest is None:
            raise UsageError(f"{path} holds no labelled dataset (no manifest.json); run `specheads gen --out {path}` first")
        if not manifest.get("complete"):
            raise UsageError(f"{path} holds an unfinished `specheads gen` run; run the same gen command again to finish it")
        stored = bool(manifest["identity"]["store_features"])
        drafter = manifest["identity"]["draft"].get("kind")
        if mode == "online" and drafter:
            raise UsageError(f"{path} was labelled with a feature drafter ({drafter}), whose states only gen computes; "
                             "use --data.mode offline (or auto)")
        if mode == "offline" and not stored:
            raise UsageError(f"{path} stores no hidden-state features; use --data.mode online (or auto), or regenerate "
                             "with --store-features true")
        if children not in CHILDREN:
            raise UsageError(f"data.children must be one of {', '.join(CHILDREN)}, got {children!r}")
        if children == "second" and "sibling_logq" not in manifest["identity"].get("sibling_columns", ()):
            raise UsageError(f"{path} holds no second-child labels with their signals (sibling_logq), which "
                             "data.children: second trains on; label it with `specheads gen --sibling_labels true`")
        sampling = manifest["identity"]["sampling"]
        if children == "second" and (sampling.get("top_k") or sampling.get("top_p", 1.0) < 1.0):
            # a position whose truncated q is one-hot has no second child and would cut the runs of drafted
            # positions the per-depth weights are built from
            raise UsageError(f"{path} was sampled with top-k/top-p, where q can be one-hot and a position have no "
                             "second child; data.children: second needs data sampled without them (top_k 0, top_p 1)")
        self.children = children
        self.path = path
        self.manifest = manifest
        self.mode = "offline" if mode == "auto" and stored else ("online" if mode == "auto" else mode)
        self.val_fraction = val_fraction
        self.calibration_fraction = calibration_fraction
        self.split_seed = split_seed
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_rows = train_rows
        self.with_target_states = False  # set by a head that reads the target's state
        self.with_markov = False  # set by a head that reads a DSpark drafter's Markov embedding
        self.splits: dict[str, datasets.Dataset] = {}

    @property
    def hidden_size(self) -> int:
        """The draft's hidden size recorded in the manifest."""
        return int(self.manifest["identity"]["draft_hidden_size"])

    @property
    def state_layer(self) -> int | None:
        """Which draft state the data's features hold (`specheads.model_outputs.states`; None: the last layer)."""
        return self.manifest["identity"].get("state_layer")

    @property
    def features_at(self) -> str:
        """Which draft states the data keeps (`data_gen.storage`; `all` for data made before the option)."""
        return storage_of(self.manifest["identity"]).at

    @property
    def drafter(self) -> str | None:
        """The feature drafter the data was labelled with (`eagle3`, `dspark`), None for a draft model."""
        return self.manifest["identity"]["draft"].get("kind")

    @property
    def markov_rank(self) -> int:
        """The rank of the Markov embedding the data stores (`markov_features`; 0: none)."""
        return int(self.manifest["identity"]["draft"].get("markov_rank") or 0)

    def require_states(self, head: str, reads: str, purpose: str) -> None:
        """Refuse a head that reads states the data did not keep (offline mode; online mode computes them all); a
        feature drafter's data keeps only the states that produced q (`data_gen.drafter_labels`)."""
        if self.drafter and reads != "context_state":
            raise UsageError(f"{self.path} was labelled with a feature drafter ({self.drafter}), whose data holds the "
                             f"state that produced each q, not the {reads} a {head} head reads; train a head that reads "
                             "the context_state (specdecpp_ontime, expected_acceptance, dspark_confidence)")
        if self.mode == "offline":
            require_states(self.features_at, head, reads, purpose, self.path)

    @property
    def draft_name(self) -> str:
        """The draft the data was labelled with, as the manifest names it."""
        return str(self.manifest["draft_name"])

    @property
    def fingerprint(self) -> str:
        """The dataset's fingerprint."""
        return str(self.manifest["fingerprint"])

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        rows = load_labelled(self.path)
        self.assign_splits(rows, [prompt_split(p, self.split_seed, self.val_fraction, self.calibration_fraction)
                                  for p in rows["prompt_id"]])
        self.training_prompts = self.prompt_digests("train")  # the training split's prompts, before any subset
        if self.train_rows is not None:
            self.take_training_subset(self.train_rows)
        wanted = ("train", "val", "calibration") if self.calibration_fraction else ("train", "val")
        if not all(len(self.splits.get(name, [])) for name in wanted):
            counts = ", ".join(f"{len(self.splits.get(name, []))} {name}" for name in wanted)
            self.splits = {}
            raise UsageError(f"the prompt split leaves {counts} rows; give more prompts or change data.val_fraction"
                             + (" or data.calibration_fraction" if self.calibration_fraction else ""))

    def take_training_subset(self, count: int) -> None:
        """Keep `count` rows of the training split, the first of a permutation seeded by `split_seed` (nested: a
        smaller subset lies inside a larger one)."""
        rows = self.splits["train"]
        if count > len(rows):
            raise UsageError(f"data.train_rows is {count} but the training split of {self.path} holds {len(rows)} rows; "
                             f"ask for at most {len(rows)} or null")
        order = np.random.default_rng(self.split_seed).permutation(len(rows))[:count]
        self.splits["train"] = rows.select(sorted(order.tolist()))
        self._digests.pop("train", None)

    @property
    def target_states(self) -> bool:
        """Whether the data stores the target's states (`specheads gen --target_states true`)."""
        return bool(self.manifest["identity"].get("target_states"))

    @property
    def target_hidden_size(self) -> int:
        """The target's hidden size, when the data stores its states."""
        return int(self.manifest["identity"]["target_hidden_size"])

    def split_by_trained_prompts(self, trained: set[str]) -> None:
        """Eval's split, for any data of the head's models: rows whose prompt (by `prompt_digest` of its token ids)
        the head trained on form "train", every other row "val", the held-out rows."""
        rows = load_labelled(self.path)
        ids = rows.with_format("numpy", columns=["prompt_ids"])["prompt_ids"]
        self.assign_splits(rows, ["train" if prompt_digest(row) in trained else "val" for row in ids])

    def assign_splits(self, rows: datasets.Dataset, splits: list[str]) -> None:
        """Each row to the split named for it ("train", "val", "calibration"); train and val always exist."""
        names = dict.fromkeys(["train", "val", *splits])
        self.splits = {name: rows.select([i for i, split in enumerate(splits) if split == name]) for name in names}
        self._digests: dict[str, list[str]] = {}

    def prompt_digests(self, split: str) -> list[str]:
        """The distinct prompts of `split`, as sorted `prompt_digest`s of their token ids (computed once a split)."""
        if split not in self._digests:
            ids = self.splits[split].with_format("numpy", columns=["prompt_ids"])["prompt_ids"]
            self._digests[split] = sorted({prompt_digest(row) for row in ids})
        return self._digests[split]

    def split_record(self) -> dict[str, Any]:
        """The split, for the run folder: which prompts went where, and the counts."""
        record: dict[str, Any] = {"data": self.path, "fingerprint": self.fingerprint, "val_fraction": self.val_fraction,
                                  "calibration_fraction": self.calibration_fraction, "split_seed": self.split_seed}
        for name, rows in self.splits.items():
            accept = rows.with_format("numpy", columns=["accept"])["accept"]
            record[name] = {"rows": len(rows), "tokens": int(sum(len(a) for a in accept)),
                            "prompt_ids": sorted(set(rows["prompt_id"])), "prompt_digests": self.prompt_digests(name)}
        return record

    def write_split(self, folder: Path) -> None:
        """Record the split in `folder/split.json` (atomic)."""
        write_json_atomic(folder / "split.json", self.split_record())

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        rows = self.splits[split]
        lengths = [len(ids) for ids in rows.with_format("numpy", columns=["mixed_ids"])["mixed_ids"]]
        trainer = self.trainer
        sampler = RankBatchSampler(lengths, self.batch_size, shuffle, self.split_seed,
                                   trainer.global_rank if trainer else 0, trainer.world_size if trainer else 1)
        return DataLoader(RowDataset(rows, self.mode == "offline", self.features_at, self.with_target_states,
                                     self.children, self.with_markov),
                          batch_sampler=sampler,
                          collate_fn=collate_rows, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def ordered_batches(self, split: str, with_features: bool, rows_per_batch: int | None = None) -> DataLoader:
        """The whole split in a fixed order (every rank sees the same), for statistics; per-position columns only
        unless `with_features` (stored features in offline mode, token ids for the draft in online mode)."""
        return DataLoader(RowDataset(self.splits[split], with_features and self.mode == "offline", self.features_at,
                                     self.with_target_states, self.children, self.with_markov),
                          batch_size=rows_per_batch or self.batch_size, collate_fn=collate_rows,
                          num_workers=self.num_workers)
