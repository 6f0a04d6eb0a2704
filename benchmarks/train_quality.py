"""Quality of trained heads on the embedded pair against the training-free signals (heads + train issue).

Runs `specheads train fit` for each experiment below on held-out prompts (the DataModule's split by
prompt) and prints a markdown table of the **final** epoch's validation metrics: no checkpoint or
hyper-parameter is chosen on the split that is reported.

    python benchmarks/train_quality.py --specdecpp runs/gen/smollm2-demo \
        --sprinter runs/gen/sprinter-t1 --sprinter-greedy runs/gen/sprinter-greedy --out runs/quality

`--sweep DATA` runs SpecDec++ Table 3 instead: D in {0, 1, 3} x w_rej in {1, 3, 6, 12}, reporting the binary KL
and AUC of the final epoch on the training and on the held-out prompts.

    python benchmarks/train_quality.py --sweep runs/gen/smollm2-demo --out runs/sweep
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jsonargparse.typing import ClosedUnitInterval, PositiveInt

from specheads.plumbing.dataclass_cli import parse_script

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ("auc_svip_entropy", "auc_draft_top1", "auc_draft_prob")
SWEEP_DEPTHS = (0, 1, 3)
SWEEP_W_REJ = (1.0, 3.0, 6.0, 12.0)


@dataclass
class QualityBenchmark:
    """Which runs to make.

    Args:
        specdecpp: gen folder with token-mixed rows (configs/gen/smollm2-demo.yaml).
        sprinter: gen folder with target-only rows at T=1.
        sprinter_greedy: gen folder with target-only rows at T=0.
        sweep: gen folder with token-mixed rows: run the D x w_rej sweep on it instead.
        state_dropout: the sweep's head_args.state_dropout.
        out: where the runs and the results go.
        epochs: override the configs' trainer.max_epochs.
    """

    specdecpp: str | None = None
    sprinter: str | None = None
    sprinter_greedy: str | None = None
    sweep: str | None = None
    state_dropout: ClosedUnitInterval = 0.5
    out: str = "runs/quality"
    epochs: PositiveInt | None = None


def experiments(args: QualityBenchmark) -> list[tuple[str, str, str, list[str]]]:
    """(name, config, data, extra flags) for every run."""
    runs = []
    if args.specdecpp:
        runs += [
            ("SpecDec++ D=3, w_rej=6, state + signals", "specdecpp.yaml", args.specdecpp, []),
            ("SpecDec++ D=3, w_rej=6, state only", "specdecpp.yaml", args.specdecpp, ["--model.extra_features", "[]"]),
            ("linear probe D=0, state + signals", "specdecpp.yaml", args.specdecpp, ["--model.head_args", "{depth: 0}"]),
            ("linear probe D=0, state only", "specdecpp.yaml", args.specdecpp,
             ["--model.head_args", "{depth: 0}", "--model.extra_features", "[]"]),
        ]
    if args.sprinter:
        runs += [("SPRINTER τ=1, T=1, state + signals", "sprinter.yaml", args.sprinter, []),
                 ("SPRINTER τ=1, T=1, state only", "sprinter.yaml", args.sprinter, ["--model.extra_features", "[]"])]
    if args.sprinter_greedy:
        runs += [("SPRINTER τ=1, T=0, state + signals", "sprinter.yaml", args.sprinter_greedy, []),
                 ("SPRINTER τ=1, T=0, state only", "sprinter.yaml", args.sprinter_greedy, ["--model.extra_features", "[]"])]
    return runs


def final_validation(root: Path) -> dict[str, float]:
    """The last validation row of metrics.csv."""
    rows = [row for row in csv.DictReader(open(root / "metrics.csv")) if row.get("val/auc")]
    return {key.removeprefix("val/"): float(value) for key, value in rows[-1].items() if key.startswith("val/") and value}


def fit(root: Path, config: str, data: str, flags: list[str], epochs: int | None) -> str:
    """Run `specheads train fit` into `root`; returns the command as a user would type it."""
    command = [sys.executable, "-m", "specheads", "train", "fit", "--config", str(ROOT / "configs/train" / config),
               "--data.path", data, "--trainer.default_root_dir", str(root),
               "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu", *flags]
    if epochs:
        command += ["--trainer.max_epochs", str(epochs)]
    if not (root / "checkpoints" / "last.ckpt").exists():  # a rerun keeps finished runs
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{root} failed:\n{done.stderr[-3000:]}")
    return " ".join(["specheads", *command[3:]])


def split_metrics(root: Path, data_path: str) -> dict[str, float]:
    """Binary KL and AUC of the run's last checkpoint on its training and on its validation prompts."""
    from specheads.artifacts.checkpoint import load_trained
    from specheads.artifacts.metrics import binary_kl, soft_auc
    from specheads.dataset.datamodule import AcceptanceDataModule
    from specheads.eval.offline import collect_tokens

    trained = load_trained(str(root / "checkpoints" / "last.ckpt"))
    data = AcceptanceDataModule(data_path, val_fraction=trained.split["val_fraction"], split_seed=trained.split["split_seed"])
    data.setup()
    metrics = {}
    for split in ("train", "val"):
        table = collect_tokens(trained, data, None, split)
        metrics[f"{split}_binary_kl"] = binary_kl(table.label, table.prediction)
        metrics[f"{split}_auc"] = soft_auc(table.label, table.prediction)
    return metrics


def quality_table(args: QualityBenchmark) -> list[dict]:
    """Every experiment's final validation metrics against the training-free signals, as a markdown table."""
    results = []
    for index, (name, config, data, flags) in enumerate(experiments(args)):
        root = Path(args.out) / f"run{index}"
        command = fit(root, config, data, flags, args.epochs)
        split = json.loads((root / "split.json").read_text())
        results.append({"name": name, "command": command, "train_tokens": split["train"]["tokens"],
                        "val_prompts": len(split["val"]["prompt_ids"]), **final_validation(root)})
        print(json.dumps(results[-1]), flush=True)
    print("\n| experiment | val labelled tokens | head AUC | best training-free AUC | margin | binary KL | constant KL | KL cut | ECE |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        best = max(BASELINES, key=lambda b: r[b])
        print(f"| {r['name']} | {int(r['tokens'])} | {r['auc']:.3f} | {r[best]:.3f} ({best[4:]}) | {r['auc'] - r[best]:+.3f} "
              f"| {r['binary_kl']:.4f} | {r['binary_kl_constant']:.4f} | {1 - r['binary_kl'] / r['binary_kl_constant']:.0%} "
              f"| {r['ece']:.3f} |")
    return results


def depth_weight_sweep(args: QualityBenchmark) -> list[dict]:
    """SpecDec++ Table 3: D x w_rej with everything else as configs/train/specdecpp.yaml; train and validation
    binary KL and AUC of the final epoch."""
    results = []
    for depth in SWEEP_DEPTHS:
        for w_rej in SWEEP_W_REJ:
            root = Path(args.out) / f"sweep-d{depth}-w{w_rej:g}"
            flags = ["--model.head_args", f"{{depth: {depth}, state_dropout: {args.state_dropout}}}", "--model.w_rej", str(w_rej)]
            command = fit(root, "specdecpp.yaml", args.sweep, flags, args.epochs)
            results.append({"depth": depth, "w_rej": w_rej, "command": command, **split_metrics(root, args.sweep)})
            print(json.dumps(results[-1]), flush=True)
    print("\n| D | w_rej | train binary KL | val binary KL | train AUC | val AUC |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['depth']} | {r['w_rej']:g} | {r['train_binary_kl']:.4f} | {r['val_binary_kl']:.4f} "
              f"| {r['train_auc']:.3f} | {r['val_auc']:.3f} |")
    return results


def main() -> None:
    args = parse_script(QualityBenchmark, "benchmarks/train_quality.py", __doc__)
    results = depth_weight_sweep(args) if args.sweep else quality_table(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / ("sweep.json" if args.sweep else "quality.json")).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
