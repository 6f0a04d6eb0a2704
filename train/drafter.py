"""`specheads train drafter`: train a drafter for a target, EAGLE-3 or DSpark, with speculators' model classes inside
a Lightning loop, on the target's own responses to the built-in prompts.

    specheads train drafter --config eagle3-smollm2 [--num-prompts N] [--max-steps S] [--out DIR]
    specheads train drafter --config dspark-smollm2 [--num-prompts N] [--max-steps S] [--out DIR]

One command, three resumable steps in `--out`: `data/` (responses and target features, chunk by chunk,
`specheads.train.drafter_data`; the same for both algorithms), `data/vocab.safetensors` (the draft vocabulary: the most
frequent response tokens of the training prompts, with speculators' d2t/t2d maps) and `train/` (Lightning checkpoints;
`last.ckpt` is resumed). An EAGLE-3 drafter trains with speculators' forward and KL loss over `ttt_steps` drafted
positions; a DSpark drafter with speculators' forward over random anchors, its blocks' KL loss (positions weighted by
exp(−k/γ)) and, jointly, its confidence head's BCE on the analytical acceptance Σ min(p, q) of each slot, as speculators
and DeepSpec train it. The finished drafter is `drafter/` in speculators' format (what vLLM serves and
`specheads.pair.eagle3.load_drafter` / `specheads.pair.dspark.load_drafter` read), and `fingerprint.json` records the
settings, the data's digest, the time each step took and the held-out metrics. Lightning picks the accelerator: the
same code runs on a CPU or a GPU. Settings are checked before the data step (`specheads.train.drafter_settings`); a
rerun resumes only under the settings in `settings.json`, one run at a time per `--out` (a lock), and a loss or a
weight that turns non-finite stops the run before any drafter is written.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from jsonargparse.typing import NonNegativeFloat, NonNegativeInt, OpenUnitInterval, PositiveFloat, PositiveInt

from specheads.dataset.prompts import load_prompts
from specheads.pair import dspark, eagle3
from specheads.pair.drafters import (
    default_layer_ids,
    fill_from_target,
    not_saved,
    save_drafter,
    speculators_models,
    vocab_maps,
)
from specheads.pair.models import ModelSpec, load_model, load_tokenizer, resolve_source, weights_identity
from specheads.plumbing.batch_end_stops import StopAtBatchEnds
from specheads.plumbing.dataclass_cli import parse_dataclass
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import check_output_folder, write_json_atomic
from specheads.plumbing.lock import folder_lock
from specheads.train.drafter_data import DTYPES, check_manifest, chunk_seconds, data_digest, read_sequences, write_chunks
from specheads.train.drafter_settings import check_resumed_settings, check_sizes, check_split, held_out


@dataclass
class DrafterConfig:
    """A drafter recipe, EAGLE-3 or DSpark.

    Args:
        algorithm: the drafter: `eagle3` (one token a forward, fusing three target layers) or `dspark` (a block a
            forward, with a Markov head and a confidence head).
        target: the target model the drafter serves.
        verifier_name: the target's name in the drafter's config.json (the Hub id vLLM loads the target by).
        out: the run folder (data/, train/, drafter/, fingerprint.json, recipe.log).
        prompts: prompt source (`builtin`, a JSONL file or a datasets name).
        num_prompts: use the first N prompts (default: all).
        samples_per_prompt: responses sampled per prompt.
        max_new_tokens: the longest response.
        temperature: the target's sampling temperature for the responses (0: greedy).
        seed: seeds the sampling, the split's shuffle, the anchors and the initialisation.
        val_fraction: share of prompts held out (chosen by a hash of the prompt id) for the held-out metrics.
        chunk_prompts: prompts per data chunk (one `generate` batch).
        features_dtype: the stored target features' dtype (bfloat16: the residual stream of SmolLM2 reaches 2.5e4, near float16's limit).
        layer_ids: the target layers read (default: 2, the middle one and the third from the end; EAGLE-3 fuses
            exactly three).
        draft_vocab_size: the draft vocabulary: this many most frequent response tokens.
        num_layers: the drafter's decoder layers.
        ttt_steps: EAGLE-3: drafted positions trained per step (its training-time test).
        ttt_step_loss_decay: EAGLE-3: weight of position k's loss is this to the power k.
        block_size: DSpark: the block one forward drafts (its candidates: all of it with `sample_from_anchor`).
        mask_token_id: DSpark: the token filling the block after its anchor (default: the tokenizer's mask token, else
            its pad, EOS or unknown token, as speculators resolves it).
        sample_from_anchor: DSpark: the anchor's slot drafts too (DSpark's and DeepSpec's convention).
        markov_rank: DSpark: the rank of the Markov head's logit bias (0: none).
        markov_head_type: DSpark: `vanilla` (a bias from the previous token), `gated` or `rnn`.
        confidence_head: DSpark: train the confidence head jointly (on [state ; Markov embedding] with a Markov head).
        confidence_head_alpha: DSpark: weight of the confidence head's BCE in the loss.
        max_anchors: DSpark: anchors (blocks) per step's packed batch.
        loss_decay_gamma: DSpark: block position k's loss is weighted by exp(−k/γ) (speculators' fixed decay).
        lr: AdamW's peak learning rate (linear warm-up, cosine decay to a tenth).
        warmup_steps: the warm-up's optimiser steps.
        max_steps: optimiser steps in all.
        tokens_per_batch: tokens packed into one step's batch (longer sequences are cut to it).
        val_every: optimiser steps between held-out evaluations.
        checkpoint_every: optimiser steps between checkpoints (the resume point).
        accelerator: Lightning's accelerator (`auto`, `cpu`, `gpu`); the data step runs on its device too.
        precision: Lightning's precision (`32-true`; `bf16-mixed` on a GPU).
    """

    algorithm: Literal["eagle3", "dspark"] = "eagle3"
    target: ModelSpec = field(default_factory=lambda: ModelSpec(path="embedded:smollm2"))
    verifier_name: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    out: str = "runs/eagle3"
    prompts: str = "builtin"
    num_prompts: PositiveInt | None = None
    samples_per_prompt: PositiveInt = 2
    max_new_tokens: PositiveInt = 192
    temperature: NonNegativeFloat = 1.0
    seed: NonNegativeInt = 0
    val_fraction: OpenUnitInterval = 0.05
    chunk_prompts: PositiveInt = 16
    features_dtype: Literal["float16", "bfloat16"] = "bfloat16"
    layer_ids: list[int] | None = None
    draft_vocab_size: PositiveInt = 8192
    num_layers: PositiveInt = 1
    ttt_steps: PositiveInt = 3
    ttt_step_loss_decay: NonNegativeFloat = 1.0
    block_size: PositiveInt = 8
    mask_token_id: NonNegativeInt | None = None
    sample_from_anchor: bool = True
    markov_rank: NonNegativeInt = 256
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    confidence_head: bool = True
    confidence_head_alpha: NonNegativeFloat = 1.0
    max_anchors: PositiveInt = 64
    loss_decay_gamma: PositiveFloat = 4.0
    lr: PositiveFloat = 3e-4
    warmup_steps: NonNegativeInt = 50
    max_steps: PositiveInt = 2000
    tokens_per_batch: PositiveInt = 1024
    val_every: PositiveInt = 200
    checkpoint_every: PositiveInt = 50
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"] = "32-true"

    def check_algorithm(self) -> None:
        """Refuse a setting of the other algorithm (it would be silently ignored)."""
        others = DSPARK_ONLY if self.algorithm == "eagle3" else EAGLE3_ONLY
        defaults = DrafterConfig()
        given = [name for name in others if getattr(self, name) != getattr(defaults, name)]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise UsageError(f"{flags} {'is a setting' if len(given) == 1 else 'are settings'} of the other drafter, "
                             f"not of --algorithm {self.algorithm}; drop {'it' if len(given) == 1 else 'them'}")

    def data_settings(self, prompts_digest: str, target_weights: dict, layer_ids: list[int]) -> dict[str, Any]:
        """What the data folder depends on (its manifest): the same for both algorithms."""
        return {"target": target_weights, "prompts": self.prompts, "prompts_digest": prompts_digest,
                "samples_per_prompt": self.samples_per_prompt, "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "seed": self.seed, "chunk_prompts": self.chunk_prompts,
                "features_dtype": self.features_dtype, "layer_ids": layer_ids}


EAGLE3_ONLY = ("ttt_steps", "ttt_step_loss_decay")
DSPARK_ONLY = ("block_size", "mask_token_id", "sample_from_anchor", "markov_rank", "markov_head_type", "confidence_head",
               "confidence_head_alpha", "max_anchors", "loss_decay_gamma")


def pack(sequences: list[Any], tokens: int, seed: int | None) -> list[list[int]]:
    """Sequence indices grouped into batches of at most `tokens` tokens each (greedily, in a seeded shuffle; in order
    without a seed)."""
    order = list(range(len(sequences)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    batches: list[list[int]] = [[]]
    used = 0
    for index in order:
        size = min(len(sequences[index].input_ids), tokens) - 1
        if batches[-1] and used + size > tokens:
            batches.append([])
            used = 0
        batches[-1].append(index)
        used += size
    return [batch for batch in batches if batch]


def collate(sequences: list[Any], tokens: int, shift: bool = True) -> dict[str, torch.Tensor]:
    """One packed batch in speculators' layout ([1, total] with document ids). Shifted as speculators' `shift_batch`
    does for EAGLE-3 (the token at t+1 with the target's features at t, the target's state at t+1, positions from 1),
    or aligned as the DFlash family reads it (`shift` False: token, features and state of t together, positions from
    0)."""
    parts: dict[str, list[torch.Tensor]] = {key: [] for key in ("input_ids", "hidden_states", "verifier_last_hidden_states",
                                                                 "loss_mask", "position_ids", "document_ids")}
    step = 1 if shift else 0
    for document, sequence in enumerate(sequences):
        size = min(len(sequence.input_ids), tokens)
        parts["input_ids"].append(sequence.input_ids[step:size])
        parts["hidden_states"].append(sequence.aux[: size - step].float())
        parts["verifier_last_hidden_states"].append(sequence.last[step:size].float())
        parts["loss_mask"].append(sequence.loss_mask[step:size])
        parts["position_ids"].append(torch.arange(step, size))
        parts["document_ids"].append(torch.full((size - step,), document))
    return {key: torch.cat(values).unsqueeze(0) for key, values in parts.items()}


class PackedData(torch.utils.data.Dataset):
    """Packed batches of sequences (packed once; a shuffling loader changes their order every epoch), shifted for
    EAGLE-3 or aligned for DSpark (`collate`)."""

    def __init__(self, sequences: list[Any], tokens: int, seed: int | None, shift: bool = True) -> None:
        self.sequences, self.tokens, self.shift = sequences, tokens, shift
        self.batches = pack(sequences, tokens, seed)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return collate([self.sequences[i] for i in self.batches[index]], self.tokens, self.shift)


class SpeculatorsModule(L.LightningModule):
    """What training a speculators drafter in our loop shares: AdamW with a warm-up and cosine decay over the trained
    weights, the training time, held-out metrics summed over the validation batches (speculators' `*_sum`/`*_total`
    pairs) and checkpoints without the target's frozen weights. Subclasses build `drafter` and define `run` (its
    forward and loss), what the progress line shows (`train_line`, `val_line`) and the held-out metrics (`held_out`)."""

    drafter: torch.nn.Module

    def __init__(self) -> None:
        super().__init__()
        self.strict_loading = False  # the target's weights are filled from the target, not from a checkpoint
        self.train_seconds = 0.0
        self.step_began: float | None = None
        self.sums: dict[str, float] = {}

    def run(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the loss, speculators' metrics) of one batch, by speculators' forward (the plain function: on CUDA
        speculators wraps it in torch.compile)."""
        raise NotImplementedError

    def forward_of_drafter(self) -> Any:
        return inspect.unwrap(type(self.drafter).forward)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, metrics = self.run(batch)
        if not torch.isfinite(loss):
            raise UsageError(f"the training loss became {float(loss.detach())} at step {self.global_step} (--lr "
                             f"{self.hparams.lr:.2e}), so the run stopped and no drafter was saved; likely a learning "
                             "rate too high: lower --lr and train into a new --out")
        self.log("train/loss", loss.detach(), prog_bar=True)
        for name, value in self.train_metrics(metrics).items():
            self.log(f"train/{name}", value)
        self.log("train/tokens", batch["loss_mask"].sum().float(), reduce_fx="sum")
        return loss

    def train_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch's metrics the training log keeps, by name."""
        return {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.step_began = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.step_began is not None:
            self.train_seconds += time.perf_counter() - self.step_began

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, metrics = self.run(batch)
        for name, value in metrics.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def ratio(self, name: str) -> float | None:
        """A held-out metric: its sum over its total, over the validation batches (None where nothing counted)."""
        total = self.sums.get(f"{name}_total", 0.0)
        return self.sums[f"{name}_sum"] / total if total else None

    def on_validation_epoch_end(self) -> None:
        for name, value in self.held_out().items():
            if value is not None:
                self.log(f"val/{name}", value)
        self.sums = {}

    def held_out(self) -> dict[str, float | None]:
        """The held-out metrics, by name (from `sums`); the loss at least."""
        return {"loss": self.ratio("loss")}

    def train_line(self, metrics: dict[str, Any]) -> str:
        """What the progress line shows of the training metrics besides the loss."""
        return ""

    def val_line(self, metrics: dict[str, Any]) -> str:
        """What the progress line shows of the held-out metrics besides the loss."""
        return ""

    def configure_optimizers(self) -> dict[str, Any]:
        trained = [p for p in self.drafter.parameters() if p.requires_grad]
        optimiser = torch.optim.AdamW(trained, lr=self.hparams.lr, weight_decay=0.0)
        warmup, total = max(self.hparams.warmup_steps, 1), self.hparams.max_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, factor)
        return {"optimizer": optimiser, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for name in not_saved(self.drafter):
            checkpoint["state_dict"].pop(f"drafter.{name}", None)
        checkpoint["train_seconds"] = self.train_seconds

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.train_seconds = float(checkpoint.get("train_seconds", 0.0))


def joined(values: list[Any]) -> str:
    """Floats as the progress line prints them."""
    return " ".join(f"{float(value):.3f}" for value in values)


class DrafterModule(SpeculatorsModule):
    """speculators' `Eagle3DraftModel` trained with its own forward and loss (KL to the target over the draft
    vocabulary, `ttt_steps` drafted positions)."""

    def __init__(self, target_config: dict[str, Any], layer_ids: list[int], draft_vocab_size: int, verifier: str,
                 num_layers: int = 1, ttt_steps: int = 3, ttt_step_loss_decay: float = 1.0, lr: float = 3e-4,
                 warmup_steps: int = 50, max_steps: int = 2000) -> None:
        super().__init__()
        from speculators.losses import resolve_loss_config
        from transformers import AutoConfig

        self.save_hyperparameters()
        config = AutoConfig.for_model(**target_config)
        self.drafter = eagle3.build_drafter(config, layer_ids, draft_vocab_size, verifier, num_layers, ttt_steps)
        self.loss_config = resolve_loss_config("kl_div", "eager")  # the fused loss needs Triton

    def run(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _, loss, metrics = self.forward_of_drafter()(self.drafter, **batch, ttt_steps=self.hparams.ttt_steps,
                                                     ttt_step_loss_decay=self.hparams.ttt_step_loss_decay,
                                                     loss_config=self.loss_config)
        return loss, metrics

    def train_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"acc_{k}": metrics[f"full_acc_{k}_sum"] / metrics[f"full_acc_{k}_total"]
                for k in range(self.hparams.ttt_steps) if metrics[f"full_acc_{k}_total"] > 0}

    def held_out(self) -> dict[str, float | None]:
        return {"loss": self.ratio("loss"),
                **{f"{kind}_{k}": self.ratio(f"{kind}_{k}") for k in range(self.hparams.ttt_steps)
                   for kind in ("full_acc", "cond_acc")}}

    def train_line(self, metrics: dict[str, Any]) -> str:
        steps = range(self.hparams.ttt_steps)
        return f"acc/position {joined([metrics[f'train/acc_{k}'] for k in steps if f'train/acc_{k}' in metrics])}"

    def val_line(self, metrics: dict[str, Any]) -> str:
        steps = range(self.hparams.ttt_steps)
        held = joined([metrics[f"val/cond_acc_{k}"] for k in steps if f"val/cond_acc_{k}" in metrics])
        return f"accuracy given the earlier positions right {held}" if held else ""


class DSparkModule(SpeculatorsModule):
    """speculators' `DSparkDraftModel` trained with its own forward and loss: random anchors in each packed batch, the
    blocks' KL to the target over the draft vocabulary (position k weighted by exp(−k/γ)), plus the confidence head's
    BCE on each slot's analytical acceptance Σ min(p, q) (speculators' and DeepSpec's joint training)."""

    def __init__(self, target_config: dict[str, Any], layer_ids: list[int], draft_vocab_size: int, verifier: str,
                 mask_token_id: int, num_layers: int = 1, block_size: int = 8, sample_from_anchor: bool = True,
                 markov_rank: int = 256, markov_head_type: str = "vanilla", confidence_head: bool = True,
                 confidence_head_alpha: float = 1.0, max_anchors: int = 64, loss_decay_gamma: float = 4.0,
                 lr: float = 3e-4, warmup_steps: int = 50, max_steps: int = 2000) -> None:
        super().__init__()
        from speculators.losses import resolve_loss_config
        from transformers import AutoConfig

        self.save_hyperparameters()
        config = AutoConfig.for_model(**target_config)
        self.drafter = dspark.build_drafter(config, layer_ids, draft_vocab_size, verifier, mask_token_id, num_layers,
                                            block_size, markov_rank, markov_head_type, sample_from_anchor, confidence_head)
        self.loss_config = resolve_loss_config("kl_div", "eager")  # the fused losses need Triton
        self.tv_loss = resolve_loss_config("tv", "eager")["tv"][0]

    def run(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hp = self.hparams
        _, loss, metrics = self.forward_of_drafter()(
            self.drafter, **batch, loss_config=self.loss_config, tv_loss_fn=self.tv_loss, gamma=hp.loss_decay_gamma,
            max_anchors=hp.max_anchors, confidence_head_alpha=hp.confidence_head_alpha,
            per_position_loss_weight="fixed-exp-decay")
        return loss, metrics

    def positions(self) -> range:
        """The block's drafting slots."""
        return range(0 if self.hparams.sample_from_anchor else 1, self.hparams.block_size)

    def train_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kept = {name: metrics[f"{name}_sum"] / metrics[f"{name}_total"]
                for name in ("accept_len", "confidence_loss", "confidence_abs_error") if f"{name}_sum" in metrics}
        return {name: value for name, value in kept.items() if torch.isfinite(value)}

    def held_out(self) -> dict[str, float | None]:
        names = ("loss", "accept_len", "eal", "accept_rate", "confidence_loss", "confidence_abs_error",
                 "confidence_pred_mean", "confidence_cumprod_bias")
        return {**{name: self.ratio(name) for name in names},
                **{f"acc_{k}": self.ratio(f"position_{k}_acc") for k in self.positions()}}

    def train_line(self, metrics: dict[str, Any]) -> str:
        parts = [f"{label} {float(metrics[f'train/{name}']):.3f}" for name, label in
                 (("accept_len", "block acceptance τ"), ("confidence_loss", "confidence BCE"))
                 if f"train/{name}" in metrics]
        return ", ".join(parts)

    def val_line(self, metrics: dict[str, Any]) -> str:
        if "val/accept_len" not in metrics:
            return ""
        accuracy = joined([metrics[f"val/acc_{k}"] for k in self.positions() if f"val/acc_{k}" in metrics])
        confidence = (f", confidence |error| {float(metrics['val/confidence_abs_error']):.3f}"
                      if "val/confidence_abs_error" in metrics else "")
        return (f"block acceptance τ {float(metrics['val/accept_len']):.3f} (greedy {float(metrics['val/eal']):.3f}), "
                f"greedy accuracy per slot {accuracy}{confidence}")


class ProgressLine(L.Callback):
    """A line per `every` optimiser steps on the recipe's log: loss, the module's training metrics, pace; a line per
    held-out evaluation."""

    def __init__(self, say: Any, every: int = 10) -> None:
        self.say, self.every = say, every

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            metrics = trainer.callback_metrics
            self.say(f"train: step {step}/{trainer.max_steps} loss {float(metrics.get('train/loss', float('nan'))):.4f} "
                     f"{module.train_line(metrics)} ({module.train_seconds:.0f} s training)")

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        line = module.val_line(metrics)
        if line:
            self.say(f"val: step {trainer.global_step} loss {float(metrics['val/loss']):.4f} {line}")


def logger_to(path: Path) -> Any:
    """A function that prints a line and appends it, timestamped, to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}"
        print(stamped, flush=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(stamped + "\n")

    return say


def device_for(accelerator: str) -> torch.device:
    """The device the data step runs on: the GPU when Lightning would train there."""
    use_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if use_gpu and not torch.cuda.is_available():
        raise UsageError(f"--accelerator {accelerator} asks for a GPU and torch sees none; use --accelerator cpu")
    return torch.device("cuda" if use_gpu else "cpu")


def vocabulary(folder: Path, train: list[Any], size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary's (d2t, t2d): read from `folder`/vocab.safetensors, else counted on the training
    sequences' response tokens and written there."""
    from safetensors.torch import load_file, save_file

    from specheads.plumbing.files import atomic_path

    path = folder / "vocab.safetensors"
    if path.is_file():
        maps = load_file(str(path))
        if maps["d2t"].numel() == size:
            return maps["d2t"], maps["t2d"]
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sequence in train:
        counts += torch.bincount(sequence.input_ids[sequence.loss_mask], minlength=vocab_size)[:vocab_size]
    d2t, t2d = vocab_maps(counts, size)
    covered = counts[t2d].sum().item() / max(counts.sum().item(), 1)
    with atomic_path(path) as temporary:
        save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, temporary, metadata={"coverage": f"{covered:.4f}"})
    return d2t, t2d


def mask_token(config: DrafterConfig, tokenizer: Any) -> int | None:
    """A DSpark drafter's mask token: `--mask-token-id`, else the tokenizer's mask token, else its pad, EOS or unknown
    token (speculators' resolution); None for EAGLE-3, or a tokenizer without any."""
    if config.algorithm != "dspark":
        return None
    if config.mask_token_id is not None:
        return config.mask_token_id
    return next((token for token in (tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id,
                                     tokenizer.unk_token_id) if token is not None), None)


def check_recipe(config: DrafterConfig, target_config: Any, mask_token_id: int | None) -> list[int]:
    """Refuse, before anything is written, what the recipe cannot train for this target; its layer ids."""
    count = target_config.num_hidden_layers
    layer_ids = config.layer_ids or default_layer_ids(count)
    if config.draft_vocab_size > target_config.vocab_size:
        raise UsageError(f"--draft-vocab-size {config.draft_vocab_size} exceeds the target's vocabulary "
                         f"({target_config.vocab_size}); give at most that")
    if config.algorithm == "eagle3":
        return eagle3.check_layer_ids(layer_ids, count, "--layer-ids")
    dspark.check_target(target_config)
    dspark.check_settings(config.block_size, mask_token_id, target_config.vocab_size, config.markov_head_type,
                          config.sample_from_anchor)
    return dspark.check_layer_ids(layer_ids, count, "--layer-ids")


def make_module(config: DrafterConfig, target_config: Any, layer_ids: list[int], mask_token_id: int | None
                ) -> SpeculatorsModule:
    """The Lightning module of `config.algorithm`, freshly initialised. Its hyperparameters are plain ints and floats
    (not jsonargparse's PositiveInt): the checkpoint's hyperparameters load with weights_only."""
    common = (json.loads(target_config.to_json_string()), [int(i) for i in layer_ids], int(config.draft_vocab_size),
              config.verifier_name)
    schedule = {"lr": float(config.lr), "warmup_steps": int(config.warmup_steps), "max_steps": int(config.max_steps)}
    if config.algorithm == "eagle3":
        return DrafterModule(*common, int(config.num_layers), int(config.ttt_steps), float(config.ttt_step_loss_decay),
                             **schedule)
    return DSparkModule(*common, int(mask_token_id), num_layers=int(config.num_layers), block_size=int(config.block_size),
                        sample_from_anchor=bool(config.sample_from_anchor), markov_rank=int(config.markov_rank),
                        markov_head_type=config.markov_head_type, confidence_head=bool(config.confidence_head),
                        confidence_head_alpha=float(config.confidence_head_alpha), max_anchors=int(config.max_anchors),
                        loss_decay_gamma=float(config.loss_decay_gamma), **schedule)


@dataclass
class Recipe:
    """What `prepare` found for a run, once its settings are known good."""

    out: Path
    device: torch.device
    prompts: list[Any]
    target_config: Any
    tokenizer: Any
    mask_token_id: int | None
    layer_ids: list[int]


def prepare(config: DrafterConfig) -> Recipe:
    """Every check of the settings that needs no model's weights: refused in one line before anything is written."""
    from transformers import AutoConfig

    out = Path(config.out)
    check_output_folder(out)
    config.check_algorithm()
    speculators_models(config.algorithm)  # refuse a missing extra before any model loads
    device = device_for(config.accelerator)
    prompts = load_prompts(config.prompts, limit=config.num_prompts)
    target_config = AutoConfig.from_pretrained(resolve_source(config.target).location)
    tokenizer = load_tokenizer(config.target)
    mask_token_id = mask_token(config, tokenizer)
    layer_ids = check_recipe(config, target_config, mask_token_id)
    check_sizes(config, target_config, tokenizer, prompts)
    check_split(prompts, config.val_fraction)
    return Recipe(out, device, prompts, target_config, tokenizer, mask_token_id, layer_ids)


def run(config: DrafterConfig) -> dict[str, Any]:
    """The whole recipe (see the module docstring), one run at a time in `--out`; returns the fingerprint."""
    recipe = prepare(config)
    with folder_lock(recipe.out, "train drafter"):
        check_resumed_settings(recipe.out, config)
        return run_recipe(config, recipe)


def run_recipe(config: DrafterConfig, recipe: Recipe) -> dict[str, Any]:
    """The data step, the training and the drafter folder, for settings `prepare` checked."""
    out, target_config = recipe.out, recipe.target_config
    say = logger_to(out / "recipe.log")  # the first thing written, once the input is known good
    block = f", blocks of {config.block_size} (mask token {recipe.mask_token_id})" if config.algorithm == "dspark" else ""
    say(f"recipe: {config.algorithm} drafter, {len(recipe.prompts)} prompts × {config.samples_per_prompt} responses at "
        f"T={config.temperature}, layers {recipe.layer_ids}, draft vocabulary {config.draft_vocab_size}{block}, "
        f"{config.max_steps} steps, on {recipe.device}")

    target = load_model(config.target).to(recipe.device)
    data = out / "data"
    prompts_digest = hashlib.sha256(json.dumps([[p.id, p.messages] for p in recipe.prompts]).encode()).hexdigest()[:16]
    check_manifest(data, config.data_settings(prompts_digest, weights_identity(config.target, target), recipe.layer_ids))
    paths = write_chunks(data, target, recipe.tokenizer, recipe.prompts, config.chunk_prompts, config.samples_per_prompt,
                         config.max_new_tokens, config.temperature, config.seed, recipe.layer_ids,
                         DTYPES[config.features_dtype], say)
    sequences = [sequence for path in paths for sequence in read_sequences(path)]
    train = [s for s in sequences if not held_out(recipe.prompts[s.prompt_index].id, config.val_fraction)]
    val = [s for s in sequences if held_out(recipe.prompts[s.prompt_index].id, config.val_fraction)]
    d2t, t2d = vocabulary(data, train, config.draft_vocab_size, target_config.vocab_size)
    say(f"data: {len(train)} training and {len(val)} held-out sequences, "
        f"{sum(int(s.loss_mask.sum()) for s in train)} training response tokens")

    L.seed_everything(config.seed, verbose=False)
    module = make_module(config, target_config, recipe.layer_ids, recipe.mask_token_id)
    fill_from_target(module.drafter, target.to("cpu"), d2t, t2d)
    del target
    trainer, held = fit(config, module, train, val, recipe.device, say)
    check_finite(module.drafter, config.lr)
    save_drafter(module.drafter.cpu(), out / "drafter")
    for stray in (out / "drafter").glob("*.py"):  # transformers copies the config class's source: never needed
        stray.unlink()
    fingerprint = {
        "command": "specheads train drafter", "algorithm": config.algorithm, "config": asdict(config),
        "config_digest": hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode()).hexdigest()[:16],
        "data_digest": data_digest(paths), "data_seconds": round(chunk_seconds(paths), 1),
        "train_seconds": round(module.train_seconds, 1), "steps": trainer.global_step, "layer_ids": recipe.layer_ids,
        "mask_token_id": recipe.mask_token_id,
        "train_sequences": len(train), "held_out_sequences": len(val), "held_out": held,
        "device": str(recipe.device) if recipe.device.type == "cpu" else torch.cuda.get_device_name(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_json_atomic(out / "fingerprint.json", fingerprint)
    say(f"done: drafter in {out / 'drafter'}; held out {held}; fingerprint {out / 'fingerprint.json'}")
    return fingerprint


def fit(config: DrafterConfig, module: SpeculatorsModule, train: list[Any], val: list[Any], device: torch.device,
        say: Any) -> tuple[L.Trainer, dict[str, float]]:
    """Train `module` on `device` (resuming `train/checkpoints/last.ckpt` where there is one); the trainer and the held-out
    metrics at the end."""
    out = Path(config.out)
    last = out / "train" / "checkpoints" / "last.ckpt"
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
        precision=config.precision, max_steps=config.max_steps, max_epochs=-1, val_check_interval=config.val_every,
        check_val_every_n_epoch=None, default_root_dir=str(out / "train"), enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=10, num_sanity_val_steps=0,
        logger=L.pytorch.loggers.CSVLogger(str(out / "train"), name="", version=""),
        callbacks=[ProgressLine(say), StopAtBatchEnds(),
                   L.pytorch.callbacks.ModelCheckpoint(dirpath=str(last.parent), filename="last", monitor=None, save_top_k=1,
                                                       every_n_train_steps=config.checkpoint_every,
                                                       enable_version_counter=False)])
    shift = config.algorithm == "eagle3"  # EAGLE-3 reads the sequences shifted, the DFlash family aligned
    train_data = torch.utils.data.DataLoader(PackedData(train, config.tokens_per_batch, config.seed, shift),
                                             batch_size=None, shuffle=True,
                                             generator=torch.Generator().manual_seed(config.seed))
    val_data = torch.utils.data.DataLoader(PackedData(val, config.tokens_per_batch, None, shift), batch_size=None)
    if last.is_file():
        say(f"train: resuming from {last}")
    trainer.fit(module, train_data, val_data, ckpt_path=str(last) if last.is_file() else None)
    trainer.save_checkpoint(str(last))
    held = {key: float(value) for key, value in trainer.validate(module, val_data, verbose=False)[0].items()}
    return trainer, held


def check_finite(drafter: torch.nn.Module, lr: float, dtype: torch.dtype = torch.float16) -> None:
    """Refuse to save a drafter with a weight that is NaN or infinite in `dtype`, the one its folder stores (every
    candidate it drafted would be accepted)."""
    left_out = not_saved(drafter)
    bad = next((name for name, tensor in drafter.state_dict().items() if name not in left_out
                and tensor.is_floating_point() and not torch.isfinite(tensor.to(dtype)).all()), None)
    if bad is not None:
        raise UsageError(f"the trained drafter's {bad} is NaN or infinite in {str(dtype).removeprefix('torch.')} (the "
                         f"dtype its folder stores), so no drafter was saved; likely a learning rate too high (--lr "
                         f"{lr:.2e}): lower --lr and train into a new --out")


def main(argv: list[str]) -> int:
    """Entry point for `specheads train drafter`."""
    config = parse_dataclass(DrafterConfig, argv, "specheads train drafter",
                             "Train an EAGLE-3 or DSpark drafter (speculators' classes) for a target on its own "
                             "responses.")
    run(config)
    return 0
