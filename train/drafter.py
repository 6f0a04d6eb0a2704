"""`specheads train drafter`: train an EAGLE-3 drafter for a target, with speculators' model classes inside a
Lightning loop, on the target's own responses to the built-in prompts.

    specheads train drafter --config eagle3-smollm2 [--num-prompts N] [--max-steps S] [--out DIR]

One command, three resumable steps in `--out`: `data/` (responses and target features, chunk by chunk,
`specheads.train.drafter_data`), `data/vocab.safetensors` (the draft vocabulary: the most frequent response tokens of
the training prompts, with speculators' d2t/t2d maps) and `train/` (Lightning checkpoints; `last.ckpt` is resumed).
The finished drafter is `drafter/` in speculators' format (what vLLM serves and `specheads.pair.eagle3.load_drafter`
reads), and `fingerprint.json` records the settings, the data's digest, the time each step took and the held-out
accuracy per drafted position. Lightning picks the accelerator: the same code runs on a CPU or a GPU.
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
from jsonargparse.typing import NonNegativeFloat, OpenUnitInterval, PositiveInt

from specheads.dataset.prompts import load_prompts
from specheads.pair.drafters import NOT_SAVED, fill_from_target, save_drafter, vocab_maps
from specheads.pair.eagle3 import build_drafter, check_layer_ids, default_layer_ids
from specheads.pair.models import ModelSpec, load_model, load_tokenizer, resolve_source, weights_identity
from specheads.plumbing.dataclass_cli import parse_dataclass
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import check_output_folder, write_json_atomic
from specheads.train.drafter_data import DTYPES, check_manifest, chunk_seconds, data_digest, read_sequences, write_chunks


@dataclass
class DrafterConfig:
    """An EAGLE-3 drafter recipe.

    Args:
        target: the target model the drafter serves.
        verifier_name: the target's name in the drafter's config.json (the Hub id vLLM loads the target by).
        out: the run folder (data/, train/, drafter/, fingerprint.json, recipe.log).
        prompts: prompt source (`builtin`, a JSONL file or a datasets name).
        num_prompts: use the first N prompts (default: all).
        samples_per_prompt: responses sampled per prompt.
        max_new_tokens: the longest response.
        temperature: the target's sampling temperature for the responses (0: greedy).
        seed: seeds the sampling, the split's shuffle and the initialisation.
        val_fraction: share of prompts held out (chosen by a hash of the prompt id) for the held-out accuracy.
        chunk_prompts: prompts per data chunk (one `generate` batch).
        features_dtype: the stored target features' dtype (bfloat16: the residual stream of SmolLM2 reaches 2.5e4, near float16's limit).
        layer_ids: the three target layers fused (default: 2, the middle one and the third from the end).
        draft_vocab_size: the draft vocabulary: this many most frequent response tokens.
        num_layers: the drafter's decoder layers.
        ttt_steps: drafted positions trained per step (EAGLE-3's training-time test).
        ttt_step_loss_decay: weight of position k's loss is this to the power k.
        lr: AdamW's peak learning rate (linear warm-up, cosine decay to a tenth).
        warmup_steps: the warm-up's optimiser steps.
        max_steps: optimiser steps in all.
        tokens_per_batch: tokens packed into one step's batch (longer sequences are cut to it).
        val_every: optimiser steps between held-out evaluations.
        checkpoint_every: optimiser steps between checkpoints (the resume point).
        accelerator: Lightning's accelerator (`auto`, `cpu`, `gpu`); the data step runs on its device too.
        precision: Lightning's precision (`32-true`; `bf16-mixed` on a GPU).
    """

    target: ModelSpec = field(default_factory=lambda: ModelSpec(path="embedded:smollm2"))
    verifier_name: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    out: str = "runs/eagle3"
    prompts: str = "builtin"
    num_prompts: PositiveInt | None = None
    samples_per_prompt: PositiveInt = 2
    max_new_tokens: PositiveInt = 192
    temperature: NonNegativeFloat = 1.0
    seed: int = 0
    val_fraction: OpenUnitInterval = 0.05
    chunk_prompts: PositiveInt = 16
    features_dtype: Literal["float16", "bfloat16"] = "bfloat16"
    layer_ids: list[int] | None = None
    draft_vocab_size: PositiveInt = 8192
    num_layers: PositiveInt = 1
    ttt_steps: PositiveInt = 3
    ttt_step_loss_decay: float = 1.0
    lr: float = 3e-4
    warmup_steps: int = 50
    max_steps: PositiveInt = 2000
    tokens_per_batch: PositiveInt = 1024
    val_every: PositiveInt = 200
    checkpoint_every: PositiveInt = 50
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    precision: str = "32-true"

    def data_settings(self, prompts_digest: str, target_weights: dict, layer_ids: list[int]) -> dict[str, Any]:
        """What the data folder depends on (its manifest)."""
        return {"target": target_weights, "prompts": self.prompts, "prompts_digest": prompts_digest,
                "samples_per_prompt": self.samples_per_prompt, "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "seed": self.seed, "chunk_prompts": self.chunk_prompts,
                "features_dtype": self.features_dtype, "layer_ids": layer_ids}


def held_out(prompt_id: str, fraction: float) -> bool:
    """Whether a prompt is held out: a hash of its id, so the split never depends on order or count."""
    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) < fraction * 16**8


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


def collate(sequences: list[Any], tokens: int) -> dict[str, torch.Tensor]:
    """One packed batch in speculators' layout ([1, total] with document ids), each sequence shifted as speculators'
    `shift_batch` does: the token at t+1 with the target's features at t, the target's state at t+1."""
    parts: dict[str, list[torch.Tensor]] = {key: [] for key in ("input_ids", "hidden_states", "verifier_last_hidden_states",
                                                                 "loss_mask", "position_ids", "document_ids")}
    for document, sequence in enumerate(sequences):
        size = min(len(sequence.input_ids), tokens)
        parts["input_ids"].append(sequence.input_ids[1:size])
        parts["hidden_states"].append(sequence.aux[: size - 1].float())
        parts["verifier_last_hidden_states"].append(sequence.last[1:size].float())
        parts["loss_mask"].append(sequence.loss_mask[1:size])
        parts["position_ids"].append(torch.arange(1, size))
        parts["document_ids"].append(torch.full((size - 1,), document))
    return {key: torch.cat(values).unsqueeze(0) for key, values in parts.items()}


class PackedData(torch.utils.data.Dataset):
    """Packed batches of sequences (packed once; a shuffling loader changes their order every epoch)."""

    def __init__(self, sequences: list[Any], tokens: int, seed: int | None) -> None:
        self.sequences, self.tokens = sequences, tokens
        self.batches = pack(sequences, tokens, seed)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return collate([self.sequences[i] for i in self.batches[index]], self.tokens)


class DrafterModule(L.LightningModule):
    """speculators' `Eagle3DraftModel` trained with its own forward and loss (KL to the target over the draft
    vocabulary, `ttt_steps` drafted positions); checkpoints leave out the target's frozen weights."""

    def __init__(self, target_config: dict[str, Any], layer_ids: list[int], draft_vocab_size: int, verifier: str,
                 num_layers: int = 1, ttt_steps: int = 3, ttt_step_loss_decay: float = 1.0, lr: float = 3e-4,
                 warmup_steps: int = 50, max_steps: int = 2000) -> None:
        super().__init__()
        from speculators.losses import resolve_loss_config
        from transformers import AutoConfig

        self.save_hyperparameters()
        config = AutoConfig.for_model(**target_config)
        self.drafter = build_drafter(config, layer_ids, draft_vocab_size, verifier, num_layers, ttt_steps)
        self.loss_config = resolve_loss_config("kl_div", "eager")  # the fused loss needs Triton
        self.strict_loading = False  # the target's weights are filled from the target, not from a checkpoint
        self.train_seconds = 0.0
        self.step_began: float | None = None
        self.sums: dict[str, float] = {}

    def run(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """speculators' forward (the plain function: on CUDA speculators wraps it in torch.compile)."""
        forward = inspect.unwrap(type(self.drafter).forward)
        _, loss, metrics = forward(self.drafter, **batch, ttt_steps=self.hparams.ttt_steps,
                                   ttt_step_loss_decay=self.hparams.ttt_step_loss_decay, loss_config=self.loss_config)
        return loss, metrics

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, metrics = self.run(batch)
        self.log("train/loss", loss.detach(), prog_bar=True)
        for k in range(self.hparams.ttt_steps):
            total = metrics[f"full_acc_{k}_total"]
            if total > 0:
                self.log(f"train/acc_{k}", metrics[f"full_acc_{k}_sum"] / total)
        self.log("train/tokens", batch["loss_mask"].sum().float(), reduce_fx="sum")
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.step_began = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.step_began is not None:
            self.train_seconds += time.perf_counter() - self.step_began

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, metrics = self.run(batch)
        for name, value in metrics.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def on_validation_epoch_end(self) -> None:
        for k in range(self.hparams.ttt_steps):
            for kind in ("full_acc", "cond_acc"):
                total = self.sums.get(f"{kind}_{k}_total", 0.0)
                if total:
                    self.log(f"val/{kind}_{k}", self.sums[f"{kind}_{k}_sum"] / total)
        if self.sums:
            self.log("val/loss", self.sums["loss_sum"] / max(self.sums["loss_total"], 1.0))
        self.sums = {}

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
        for name in NOT_SAVED:
            checkpoint["state_dict"].pop(f"drafter.{name}", None)
        checkpoint["train_seconds"] = self.train_seconds

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.train_seconds = float(checkpoint.get("train_seconds", 0.0))


class ProgressLine(L.Callback):
    """A line per `every` optimiser steps on the recipe's log: loss, accuracy per drafted position, pace."""

    def __init__(self, say: Any, every: int = 10) -> None:
        self.say, self.every = say, every

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            metrics = trainer.callback_metrics
            accuracy = " ".join(f"{float(metrics[f'train/acc_{k}']):.3f}" for k in range(module.hparams.ttt_steps)
                                if f"train/acc_{k}" in metrics)
            self.say(f"train: step {step}/{trainer.max_steps} loss {float(metrics.get('train/loss', float('nan'))):.4f} "
                     f"acc/position {accuracy} ({module.train_seconds:.0f} s training)")

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        held = " ".join(f"{float(metrics[f'val/cond_acc_{k}']):.3f}" for k in range(module.hparams.ttt_steps)
                        if f"val/cond_acc_{k}" in metrics)
        if held:
            self.say(f"val: step {trainer.global_step} loss {float(metrics['val/loss']):.4f} "
                     f"accuracy given the earlier positions right {held}")


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


def run(config: DrafterConfig) -> dict[str, Any]:
    """The whole recipe (see the module docstring); returns the fingerprint."""
    from transformers import AutoConfig

    from specheads.pair.eagle3 import speculators_eagle3

    out = Path(config.out)
    check_output_folder(out)
    speculators_eagle3()  # refuse a missing extra before any model loads
    device = device_for(config.accelerator)
    prompts = load_prompts(config.prompts, limit=config.num_prompts)
    target_config = AutoConfig.from_pretrained(resolve_source(config.target).location)
    count = target_config.num_hidden_layers
    layer_ids = check_layer_ids(config.layer_ids or default_layer_ids(count), count, "--layer-ids")
    if config.draft_vocab_size > target_config.vocab_size:
        raise UsageError(f"--draft-vocab-size {config.draft_vocab_size} exceeds the target's vocabulary "
                         f"({target_config.vocab_size}); give at most that")
    say = logger_to(out / "recipe.log")  # the first thing written, once the input is known good
    say(f"recipe: {len(prompts)} prompts × {config.samples_per_prompt} responses at T={config.temperature}, layers "
        f"{layer_ids}, draft vocabulary {config.draft_vocab_size}, {config.max_steps} steps, on {device}")

    tokenizer = load_tokenizer(config.target)
    target = load_model(config.target).to(device)
    data = out / "data"
    prompts_digest = hashlib.sha256(json.dumps([[p.id, p.messages] for p in prompts]).encode()).hexdigest()[:16]
    check_manifest(data, config.data_settings(prompts_digest, weights_identity(config.target, target), layer_ids))
    paths = write_chunks(data, target, tokenizer, prompts, config.chunk_prompts, config.samples_per_prompt,
                         config.max_new_tokens, config.temperature, config.seed, layer_ids, DTYPES[config.features_dtype], say)
    sequences = [sequence for path in paths for sequence in read_sequences(path)]
    train = [s for s in sequences if not held_out(prompts[s.prompt_index].id, config.val_fraction)]
    val = [s for s in sequences if held_out(prompts[s.prompt_index].id, config.val_fraction)]
    if not train or not val:
        raise UsageError(f"{len(prompts)} prompts leave {len(train)} training and {len(val)} held-out sequences at "
                         f"--val-fraction {config.val_fraction}; give more prompts or another fraction")
    d2t, t2d = vocabulary(data, train, config.draft_vocab_size, target_config.vocab_size)
    say(f"data: {len(train)} training and {len(val)} held-out sequences, "
        f"{sum(int(s.loss_mask.sum()) for s in train)} training response tokens")

    L.seed_everything(config.seed, verbose=False)
    # plain ints and floats (not jsonargparse's PositiveInt): the checkpoint's hyperparameters load with weights_only
    module = DrafterModule(json.loads(target_config.to_json_string()), [int(i) for i in layer_ids],
                           int(config.draft_vocab_size), config.verifier_name, int(config.num_layers), int(config.ttt_steps),
                           float(config.ttt_step_loss_decay), float(config.lr), int(config.warmup_steps), int(config.max_steps))
    fill_from_target(module.drafter, target.to("cpu"), d2t, t2d)
    del target
    last = out / "train" / "checkpoints" / "last.ckpt"
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision=config.precision,
        max_steps=config.max_steps, max_epochs=-1, val_check_interval=config.val_every, check_val_every_n_epoch=None,
        default_root_dir=str(out / "train"), enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10,
        num_sanity_val_steps=0, logger=L.pytorch.loggers.CSVLogger(str(out / "train"), name="", version=""),
        callbacks=[ProgressLine(say),
                   L.pytorch.callbacks.ModelCheckpoint(dirpath=str(last.parent), filename="last", monitor=None, save_top_k=1,
                                                       every_n_train_steps=config.checkpoint_every,
                                                       enable_version_counter=False)])
    train_data = torch.utils.data.DataLoader(PackedData(train, config.tokens_per_batch, config.seed), batch_size=None,
                                             shuffle=True, generator=torch.Generator().manual_seed(config.seed))
    val_data = torch.utils.data.DataLoader(PackedData(val, config.tokens_per_batch, None), batch_size=None)
    if last.is_file():
        say(f"train: resuming from {last}")
    trainer.fit(module, train_data, val_data, ckpt_path=str(last) if last.is_file() else None)
    trainer.save_checkpoint(str(last))
    held = {key: float(value) for key, value in trainer.validate(module, val_data, verbose=False)[0].items()}

    save_drafter(module.drafter.cpu(), out / "drafter")
    for stray in (out / "drafter").glob("*.py"):  # transformers copies the config class's source: never needed
        stray.unlink()
    fingerprint = {
        "command": "specheads train drafter", "config": asdict(config),
        "config_digest": hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode()).hexdigest()[:16],
        "data_digest": data_digest(paths), "data_seconds": round(chunk_seconds(paths), 1),
        "train_seconds": round(module.train_seconds, 1), "steps": trainer.global_step, "layer_ids": layer_ids,
        "train_sequences": len(train), "held_out_sequences": len(val), "held_out": held,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_json_atomic(out / "fingerprint.json", fingerprint)
    say(f"done: drafter in {out / 'drafter'}; held out {held}; fingerprint {out / 'fingerprint.json'}")
    return fingerprint


def main(argv: list[str]) -> int:
    """Entry point for `specheads train drafter`."""
    config = parse_dataclass(DrafterConfig, argv, "specheads train drafter",
                             "Train an EAGLE-3 drafter (speculators' classes) for a target on its own responses.")
    run(config)
    return 0
