"""Quality of trained heads on the embedded pair against the training-free signals (heads + train issue).

Runs `specheads train fit` for each experiment below on held-out prompts (the DataModule's split by
prompt) and prints a markdown table of the **final** epoch's validation metrics: no checkpoint or
hyper-parameter is chosen on the split that is reported.

    python benchmarks/train_quality.py --specdecpp runs/gen/smollm2-demo \
        --sprinter runs/gen/sprinter-t1 --sprinter-greedy runs/gen/sprinter-greedy --out runs/quality
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ("auc_svip_entropy", "auc_draft_top1", "auc_draft_prob")


def experiments(args: argparse.Namespace) -> list[tuple[str, str, str, list[str]]]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specdecpp", help="gen folder with token-mixed rows (configs/gen/smollm2-demo.yaml)")
    parser.add_argument("--sprinter", help="gen folder with target-only rows at T=1")
    parser.add_argument("--sprinter-greedy", help="gen folder with target-only rows at T=0")
    parser.add_argument("--out", default="runs/quality")
    parser.add_argument("--epochs", type=int, help="override the configs' trainer.max_epochs")
    args = parser.parse_args()
    results = []
    for index, (name, config, data, flags) in enumerate(experiments(args)):
        root = Path(args.out) / f"run{index}"
        command = [sys.executable, "-m", "specheads", "train", "fit", "--config", str(ROOT / "configs/train" / config),
                   "--data.path", data, "--trainer.default_root_dir", str(root),
                   "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu", *flags]
        if args.epochs:
            command += ["--trainer.max_epochs", str(args.epochs)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
        split = json.loads((root / "split.json").read_text())
        metrics = final_validation(root)
        results.append({"name": name, "command": " ".join(["specheads", *command[3:]]), "train_tokens": split["train"]["tokens"],
                        "val_prompts": len(split["val"]["prompt_ids"]), **metrics})
        print(json.dumps(results[-1]), flush=True)
    print("\n| experiment | val labelled tokens | head AUC | best training-free AUC | margin | binary KL | constant KL | KL cut | ECE |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        best = max(BASELINES, key=lambda b: r[b])
        print(f"| {r['name']} | {int(r['tokens'])} | {r['auc']:.3f} | {r[best]:.3f} ({best[4:]}) | {r['auc'] - r[best]:+.3f} "
              f"| {r['binary_kl']:.4f} | {r['binary_kl_constant']:.4f} | {1 - r['binary_kl'] / r['binary_kl_constant']:.0%} "
              f"| {r['ece']:.3f} |")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "quality.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
