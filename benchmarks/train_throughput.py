"""Training throughput (heads + train issue): labelled tokens per second in offline and online mode, peak
memory, and the share of step time spent loading data.

Each mode runs `specheads train fit` with configs/train/specdecpp.yaml in its own process (so that peak
memory is that mode's). A callback times every training batch: the step (in online mode it includes the
frozen draft's forward) and the gap before it, in which Lightning fetches and collates the batch, moves it
to the device and does its per-step bookkeeping (reported as data loading: an upper bound). The first
epoch is a warm-up and is not counted; labelled tokens are counted per batch with the mask the loss uses.

CPU, embedded pair (data from `specheads gen --config configs/gen/smollm2-demo.yaml`):

    python benchmarks/train_throughput.py --data runs/gen/smollm2-demo --out runs/bench/train

GPU, a random-initialised draft of 1B-class shape in bf16 (Llama-3.2-1B's 16 layers, width 2048,
SmolLM2's 49k vocabulary; it is the 18-layer target minus its last two layers). The benchmark writes
the model folder and labels data with it first (`specheads gen`), then measures:

    python benchmarks/train_throughput.py --random-draft --tokenizer-from DIR --out runs/bench/train-gpu \
        --accelerator gpu
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.pytorch.callbacks import Callback

from specheads.plumbing.dataclass_cli import parse_script

ROOT = Path(__file__).resolve().parents[1]
RANDOM_TARGET_LAYERS, RANDOM_DRAFT_SKIPS = 18, [16, 17]


class BatchTimer(Callback):
    """Per training batch: labelled tokens (the positions the loss reads), the step's time, and the time since the
    previous step ended (fetching the batch and moving it to the device); the first batch of an epoch is skipped,
    its gap holds validation and the epoch's set-up."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.ended = self.started = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        synchronize(module.device)
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        from specheads.dataset.targets import token_targets

        synchronize(module.device)
        now = time.perf_counter()
        if batch_idx > 0:
            mask, _ = token_targets(batch, module.purpose, module.hparams.tau, module.hparams.contexts)
            self.rows.append({"epoch": trainer.current_epoch, "tokens": int(mask.sum()),
                              "step_s": now - self.started, "data_s": self.started - self.ended})
        self.ended = time.perf_counter()


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that host timers see it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(data: str, mode: str, root: Path, accelerator: str, epochs: int, num_workers: int) -> dict:
    """Train in this process; labelled tokens/s after the first epoch, data-loading share and peak memory."""
    from specheads.train.cli import build_cli

    timer = BatchTimer()
    argv = ["fit", "--config", str(ROOT / "configs/train/specdecpp.yaml"), "--data.path", data, "--data.mode", mode,
            "--trainer.default_root_dir", str(root), "--trainer.max_epochs", str(epochs),
            "--data.num_workers", str(num_workers), "--trainer.accelerator", accelerator,
            "--trainer.enable_progress_bar", "false"]
    started = time.perf_counter()
    cli = build_cli(argv, callbacks=[timer])
    total_s = time.perf_counter() - started
    warm = [r for r in timer.rows if r["epoch"] > 0]  # the first epoch warms caches, allocators and the page cache
    step_s, data_s, tokens = (sum(r[key] for r in warm) for key in ("step_s", "data_s", "tokens"))
    result = {"mode": mode, "accelerator": accelerator, "device": device_name(accelerator), "epochs": epochs,
              "batches_measured": len(warm), "batch_rows": cli.datamodule.batch_size,
              "labelled_tokens_measured": tokens, "labelled_tokens_per_s": tokens / (step_s + data_s),
              "step_ms": 1000 * step_s / len(warm), "data_loading_share": data_s / (step_s + data_s),
              "peak_rss_mib": peak_rss_mib(), "fit_wall_s": total_s, "num_workers": num_workers,
              "draft": cli.datamodule.draft_name, "draft_hidden_size": cli.datamodule.hidden_size,
              "head_parameters": sum(p.numel() for p in cli.model.head.parameters())}
    if torch.cuda.is_available() and accelerator != "cpu":
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM; unlike ru_maxrss it is not inherited across exec)."""
    line = next(row for row in Path("/proc/self/status").read_text().splitlines() if row.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def device_name(accelerator: str) -> str:
    """The GPU's name, or the CPU's thread count."""
    if accelerator != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu, {torch.get_num_threads()} threads"


def random_draft_pair(folder: Path, tokenizer_from: str) -> Path:
    """A random-initialised Llama folder (bf16) of 1B-class shape with the tokenizer of `tokenizer_from`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    if (folder / "config.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=RANDOM_TARGET_LAYERS, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def label_with_random_draft(model: Path, out: Path, accelerator: str) -> str:
    """`specheads gen` with the random pair: the demo's settings, bf16, two samples per built-in prompt."""
    if not (out / "manifest.json").is_file():
        command = [sys.executable, "-m", "specheads", "gen", "--config", str(ROOT / "configs/gen/smollm2-demo.yaml"),
                   "--target.path", str(model), "--target.dtype", "bfloat16", "--draft.dtype", "bfloat16",
                   "--draft.skip_layers", json.dumps(RANDOM_DRAFT_SKIPS), "--samples_per_prompt", "2",
                   "--sampling.max_new_tokens", "128", "--batch_size", "32", "--accelerator", accelerator,
                   "--progress", "false", "--out", str(out)]
        subprocess.run(command, check=True)
    return str(out)


@dataclass
class TrainBenchmark:
    """What to measure.

    Args:
        data: a `specheads gen` folder with stored features.
        random_draft: label data with a random 1B-class bf16 pair first.
        tokenizer_from: model folder whose tokenizer the random pair uses.
        out: where the runs and the results go.
        accelerator: Lightning's accelerator (cpu, gpu).
        epochs: epochs per mode; the first is not counted.
        modes: the data modes to measure.
        num_workers: DataLoader workers (data.num_workers).
        measure: internal: measure one mode in this process.
    """

    data: str | None = None
    random_draft: bool = False
    tokenizer_from: str | None = None
    out: str = "runs/bench/train"
    accelerator: str = "cpu"
    epochs: PositiveInt = 3
    modes: list[Literal["offline", "online"]] = field(default_factory=lambda: ["offline", "online"])
    num_workers: NonNegativeInt = 0
    measure: Literal["offline", "online"] | None = None


def main() -> None:
    args = parse_script(TrainBenchmark, "benchmarks/train_throughput.py", __doc__)
    out = Path(args.out)
    if args.measure:
        print(json.dumps(measure(args.data, args.measure, out / args.measure, args.accelerator, args.epochs,
                                 args.num_workers)))
        return
    if args.random_draft:
        if not args.tokenizer_from:
            raise SystemExit("--random-draft needs --tokenizer-from DIR (a model folder with a tokenizer)")
        args.data = label_with_random_draft(random_draft_pair(out / "random-pair", args.tokenizer_from),
                                            out / "data", args.accelerator)
    if not args.data:
        raise SystemExit("give --data DIR (a `specheads gen` folder with features) or --random-draft")
    results = []
    for mode in args.modes:
        done = subprocess.run([sys.executable, __file__, "--measure", mode, "--data", args.data, "--out", str(out),
                               "--accelerator", args.accelerator, "--epochs", str(args.epochs),
                               "--num-workers", str(args.num_workers)],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"throughput-w{args.num_workers}.json").write_text(json.dumps(results, indent=2))
    print("\n| mode | workers | labelled tokens/s | step | data loading share | peak RSS | peak GPU memory |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        gpu = f"{r['peak_gpu_mib']:.0f} MiB" if "peak_gpu_mib" in r else "–"
        print(f"| {r['mode']} | {r['num_workers']} | {r['labelled_tokens_per_s']:,.0f} | {r['step_ms']:.1f} ms "
              f"| {r['data_loading_share']:.1%} | {r['peak_rss_mib']:,.0f} MiB | {gpu} |")


if __name__ == "__main__":
    main()
