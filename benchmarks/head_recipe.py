"""What limits the on-time head (issue 37): a learning curve, input ablations and loss variants, each judged on the
same held-out tokens with bootstrap intervals over prompts, and the calibration split's size.

Four steps, each resumable (a finished run is not trained again):

    # the same labelled rows with the draft state at another layer and/or the target's states: their responses are
    # imported, so sampling is skipped, and the labels come out identical (same row seeds)
    python benchmarks/head_recipe.py restate --data runs/gen/smollm2-demo --out runs/gen/smollm2-demo-ts \
        --gen-flags "--target_states true"
    python benchmarks/head_recipe.py restate --data runs/gen/smollm2-demo --out runs/gen/smollm2-demo-l12 \
        --gen-flags "--state_layer 12"
    # recipe variants on split 1 (not the reported split): inputs and losses against the shipped config
    python benchmarks/head_recipe.py compare --data runs/gen/smollm2-demo-ts --split-seed 1 --out runs/recipe/compare \
        --layer-data '{"draft layer 12": "runs/gen/smollm2-demo-l12"}'
    # the learning curve on split 0: 1/16 .. 1 of the training rows, the same held-out prompts, equal optimiser steps
    python benchmarks/head_recipe.py curve --data runs/gen/smollm2-demo-ts --split-seed 0 --out runs/recipe/curve
    # how many calibration prompts the per-position maps need: refits on nested subsets of the calibration split
    python benchmarks/head_recipe.py calibration --data runs/gen/smollm2-demo-ts --out runs/recipe/curve

Each step writes `results.json` in its --out and prints a markdown table; `curve` also draws `learning_curve.png`.
Two trainings run at once with `--jobs 2`, one torch thread each (the 2-core machine's best use).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from specheads.plumbing.dataclass_cli import parse_script
from specheads.plumbing.files import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "train" / "specdecpp-ontime.yaml"
MAX_POSITIONS = 6
REFERENCE = "shipped config"
VARIANTS: dict[str, list[str]] = {
    REFERENCE: [],
    "no candidate embedding": ["--model.candidate_embedding", "false"],
    "no draft signals": ["--model.extra_features", "[]"],
    "+ target's last verified state": ["--model.target_state", "true"],
    "position-weighted BCE (γ = 4, w_rej 6)": ["--model.position_gamma", "4"],
    "DSpark's loss: position-weighted soft BCE (γ = 4, w_rej 1)": ["--model.position_gamma", "4", "--model.w_rej", "1"],
    "+ auxiliary α target (weight 0.5)": ["--model.alpha_weight", "0.5"],
}
"""The recipe variants `compare` trains: extra `specheads train fit` flags on top of configs/train/specdecpp-ontime.yaml."""


@dataclass
class RecipeBenchmark:
    """Which step to run.

    Args:
        step: `restate`, `compare`, `curve` or `calibration` (see the module docstring).
        data: the labelled dataset (`restate`: the one whose responses are imported).
        out: where the runs and results.json go (`restate`: the new dataset's folder).
        split_seed: the prompt split's seed (1 chooses the recipe, 0 reports it).
        variants: `compare` only these names of VARIANTS (default: all).
        layer_data: `compare` also trains the shipped config on these datasets (name: folder), the same rows with the
            draft state at another layer.
        fractions: `curve`'s shares of the training rows.
        flags: extra `train fit` flags for every run (for `curve`: the recipe under test).
        base_steps_epochs: `curve` trains every size for as many optimiser steps as the whole split takes in this many
            epochs (and validates as often), so a small subset is not also an under-trained one.
        calibration_prompts: `calibration`'s nested subset sizes of the calibration prompts.
        gen_config: `restate`'s `specheads gen` config, the one `data` was made with.
        gen_flags: `restate`'s extra `specheads gen` flags (the states to store).
        val_fraction, calibration_fraction: the prompt split's shares (as the config's data section).
        resamples: bootstrap resamples over prompts.
        jobs: trainings run at once (each with one torch thread when more than one).
    """

    step: Literal["restate", "compare", "curve", "calibration"]
    data: str
    out: str
    split_seed: int = 0
    variants: list[str] | None = None
    layer_data: dict[str, str] = field(default_factory=dict)
    fractions: list[float] = field(default_factory=lambda: [1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0])
    flags: str = ""
    base_steps_epochs: int = 24
    calibration_prompts: list[int] = field(default_factory=lambda: [2, 4, 8, 16])
    gen_config: str = str(ROOT / "configs" / "gen" / "smollm2-demo.yaml")
    gen_flags: str = ""
    val_fraction: float = 0.1
    calibration_fraction: float = 0.1
    resamples: int = 200
    jobs: int = 1


# ---- restate: the same rows, other states


def restate(args: RecipeBenchmark) -> None:
    """Write the dataset's responses (token ids, in sample order) and label them again with `gen_flags`."""
    from specheads.dataset.store import load_labelled

    rows = load_labelled(args.data).with_format("numpy", columns=["prompt_id", "sample_index", "target_ids"])
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["prompt_id"], int(rows[i]["sample_index"])))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    responses = out.parent / f"{out.name}.responses.jsonl"
    lines = [json.dumps({"id": str(rows[i]["prompt_id"]), "response_ids": rows[i]["target_ids"].tolist()}) for i in order]
    responses.write_text("\n".join(lines) + "\n")
    command = ["specheads", "gen", "--config", args.gen_config, "--responses", str(responses), "--out", str(out),
               "--progress", "false", *shlex.split(args.gen_flags)]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    check_same_labels(args.data, args.out)


def check_same_labels(first: str, second: str) -> None:
    """Refuse restated data whose rows or labels differ from the original's (same prompt, sample, tokens, labels)."""
    from specheads.dataset.store import load_labelled

    def keyed(path: str) -> dict[tuple[str, int], dict[str, Any]]:
        rows = load_labelled(path).with_format("numpy", columns=["prompt_id", "sample_index", "mixed_ids", "accept"])
        return {(str(r["prompt_id"]), int(r["sample_index"])): r for r in rows}

    a, b = keyed(first), keyed(second)
    if a.keys() != b.keys():
        raise SystemExit(f"{second} holds other rows than {first}")
    worst = max(float(np.abs(a[k]["accept"] - b[k]["accept"]).max()) for k in a)
    same_tokens = all(np.array_equal(a[k]["mixed_ids"], b[k]["mixed_ids"]) for k in a)
    print(f"restated {len(a)} rows: mixed tokens identical: {same_tokens}; largest label difference {worst:.2e}")
    if not same_tokens:
        raise SystemExit(f"{second}'s mixed tokens differ from {first}'s: the restated rows are not the same")


# ---- training and held-out scoring


def fit(name: str, data: str, folder: Path, flags: list[str], args: RecipeBenchmark, threads: int) -> Path:
    """Train one head (skipped when the run finished before: last.ckpt is written every epoch, so a `finished` file
    marks the end); returns the checkpoint."""
    checkpoint, log, finished = folder / "checkpoints" / "last.ckpt", folder / "train.log", folder / "finished"
    if checkpoint.is_file() and finished.is_file():
        return checkpoint
    command = ["specheads", "train", "fit", "--config", str(CONFIG), "--data.path", data, "--data.split_seed",
               str(args.split_seed), "--data.val_fraction", str(args.val_fraction), "--data.calibration_fraction",
               str(args.calibration_fraction), "--trainer.default_root_dir", str(folder),
               "--trainer.enable_progress_bar", "false", *flags]
    shutil.rmtree(folder, ignore_errors=True)  # an unfinished run starts again (Lightning would write last-v1.ckpt)
    folder.mkdir(parents=True)
    print(f"[{name}] {' '.join(command)}", flush=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} if threads == 1 else {})}
    with open(log, "w") as output:
        subprocess.run(command, check=True, stdout=output, stderr=subprocess.STDOUT, env=env)
    finished.write_text(" ".join(command) + "\n")
    return checkpoint


def fit_all(runs: list[tuple[str, str, Path, list[str]]], args: RecipeBenchmark) -> dict[str, Path]:
    """Train every (name, data, folder, flags), `jobs` at a time."""
    threads = 1 if args.jobs > 1 else 0
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {name: pool.submit(fit, name, data, folder, flags, args, threads)
                   for name, data, folder, flags in runs}
        return {name: future.result() for name, future in futures.items()}


@dataclass
class Scored:
    """One head's held-out tokens and its figures."""

    table: Any
    figures: dict[str, Any]


def score(checkpoint: Path, data: str, draft: Any, resamples: int) -> Scored:
    """The head's held-out figures, as `specheads eval` computes them: AUC, its margin over q(ŷ) (`draft_prob`) with a
    bootstrap interval over prompts, binary KL, and the calibrated cumulative ECE per k with its interval."""
    from specheads.artifacts.checkpoint import load_trained
    from specheads.artifacts.metrics import soft_auc
    from specheads.eval.config import EvalConfig
    from specheads.eval.offline import bootstrap_indices, collect_tokens, cumulative_calibration, interval, offline_metrics
    from specheads.eval.run import held_out_data

    trained = load_trained(str(checkpoint))
    manifest = json.loads((Path(data) / "manifest.json").read_text())
    held_out, _ = held_out_data(EvalConfig(head=str(checkpoint), data=data, out="unused"), trained, manifest)
    table = collect_tokens(trained, held_out, draft)
    metrics = offline_metrics(table, resamples=resamples)["signals"]
    q = np.exp(table.logq)
    margins = [soft_auc(table.label[i], table.prediction[i]) - soft_auc(table.label[i], q[i])
               for i in bootstrap_indices(table.group, resamples, 1)]
    cumulative = cumulative_calibration(table, trained.head.calibration, MAX_POSITIONS, resamples=resamples)
    stage = "calibrated" if trained.head.calibration is not None else "raw"
    figures = {"tokens": int(len(table.label)), "prompts": int(table.prompts), "auc": metrics["head"]["auc"],
               "auc_ci": metrics["head"]["auc_ci"], "auc_q": metrics["draft_prob"]["auc"],
               "margin_q": metrics["head"]["auc"] - metrics["draft_prob"]["auc"], "margin_q_ci": interval(margins),
               "binary_kl": metrics["head"]["binary_kl"], "binary_kl_ci": metrics["head"]["binary_kl_ci"],
               "binary_kl_constant": metrics["constant"]["binary_kl"],
               "ece": {row["k"]: [row["ece"], *(row["ece_ci"] or [None, None])] for row in cumulative
                       if row["stage"] == stage},
               "ece_raw": {row["k"]: row["ece"] for row in cumulative if row["stage"] == "raw"}}
    return Scored(table, figures)


def paired_auc_difference(first: Any, second: Any, resamples: int) -> tuple[float, list[float] | None]:
    """AUC(second) − AUC(first) on the same tokens, with a paired bootstrap interval over prompts."""
    from specheads.artifacts.metrics import soft_auc
    from specheads.eval.offline import bootstrap_indices, interval

    # restated data holds the same tokens; its labels may differ in the last float32 bits (another thread count)
    if not np.array_equal(first.group, second.group) or not np.allclose(first.label, second.label, atol=1e-4):
        raise SystemExit("the two heads were scored on different held-out tokens; compare runs on the same rows")
    point = soft_auc(second.label, second.prediction) - soft_auc(first.label, first.prediction)
    samples = [soft_auc(second.label[i], second.prediction[i]) - soft_auc(first.label[i], first.prediction[i])
               for i in bootstrap_indices(first.group, resamples, 2)]
    return point, interval(samples)


def load_draft(data: str) -> Any:
    """The dataset's draft (its input embeddings feed the candidate-embedding heads)."""
    from specheads.pair.models import ModelSpec, load_pair

    source = json.loads((Path(data) / "manifest.json").read_text())["config"]
    return load_pair(ModelSpec(**source["target"]), ModelSpec(**source["draft"])).draft


def ece_cells(figures: dict[str, Any]) -> str:
    """Calibrated cumulative ECE per k as table cells."""
    return " | ".join(f"{figures['ece'][k][0]:.3f}" if k in figures["ece"] else "–" for k in range(1, MAX_POSITIONS + 1))


def span(values: list[float] | None, digits: int = 3) -> str:
    """An interval as text."""
    return "–" if not values else f"[{values[0]:+.{digits}f}, {values[1]:+.{digits}f}]"


# ---- the steps


def compare(args: RecipeBenchmark) -> dict[str, Any]:
    """Train every variant (and the layer datasets) on `split_seed` and score each against the shipped config."""
    out = Path(args.out)
    names = args.variants or list(VARIANTS)
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    if REFERENCE not in names:
        names = [REFERENCE, *names]
    common = shlex.split(args.flags)
    runs = [(name, args.data, out / slug(name), [*VARIANTS[name], *common]) for name in names]
    runs += [(name, path, out / slug(name), common) for name, path in args.layer_data.items()]
    checkpoints = fit_all(runs, args)
    draft = load_draft(args.data)
    scored = {name: score(checkpoints[name], data, draft, args.resamples) for name, data, _, _ in runs}
    results: dict[str, Any] = {"data": args.data, "split_seed": args.split_seed, "runs": {}}
    lines = [f"| recipe (split {args.split_seed}) | AUC | margin over q(ŷ) | ΔAUC vs shipped [95 %] | binary KL | "
             "ECE k=1..6 (calibrated) |", "|---|---|---|---|---|---|"]
    for name, _, _, flags in runs:
        figures = scored[name].figures
        difference, difference_ci = (0.0, None) if name == REFERENCE else paired_auc_difference(
            scored[REFERENCE].table, scored[name].table, args.resamples)
        results["runs"][name] = {"flags": flags, **figures, "auc_vs_shipped": difference,
                                 "auc_vs_shipped_ci": difference_ci}
        lines.append(f"| {name} | {figures['auc']:.3f} | {figures['margin_q']:+.3f} {span(figures['margin_q_ci'])} | "
                     f"{difference:+.3f} {span(difference_ci)} | {figures['binary_kl']:.3f} | {ece_cells(figures)} |")
    results["table"] = lines
    return results


def curve(args: RecipeBenchmark) -> dict[str, Any]:
    """Train on nested shares of the training rows for equal optimiser steps and score each on the same prompts."""
    from specheads.dataset.datamodule import AcceptanceDataModule

    full = AcceptanceDataModule(args.data, val_fraction=args.val_fraction,
                                calibration_fraction=args.calibration_fraction, split_seed=args.split_seed)
    full.setup()
    total_rows = len(full.splits["train"])
    runs = []
    for fraction in sorted(args.fractions):
        rows = max(int(round(fraction * total_rows)), 1)
        scale = total_rows / rows
        epochs = int(round(args.base_steps_epochs * scale))
        flags = ["--data.train_rows", str(rows), "--trainer.max_epochs", str(epochs),
                 "--trainer.check_val_every_n_epoch", str(max(int(round(scale)), 1)), *shlex.split(args.flags)]
        runs.append((f"{rows} rows", args.data, Path(args.out) / f"rows{rows}", flags))
    checkpoints = fit_all(runs, args)
    draft = load_draft(args.data)
    results: dict[str, Any] = {"data": args.data, "split_seed": args.split_seed, "flags": args.flags, "runs": {}}
    lines = ["| training rows | labelled tokens | AUC | margin over q(ŷ) [95 %] | binary KL (constant) | "
             "ECE k=1..6 (calibrated) |", "|---|---|---|---|---|---|"]
    for name, data, folder, flags in runs:
        figures = score(checkpoints[name], data, draft, args.resamples).figures
        split = json.loads(next(folder.rglob("split.json")).read_text())
        figures["train_tokens"] = split["train"]["tokens"]
        figures["train_rows"] = split["train"]["rows"]
        results["runs"][name] = {"flags": flags, **figures}
        lines.append(f"| {figures['train_rows']} | {figures['train_tokens']:,} | {figures['auc']:.3f} | "
                     f"{figures['margin_q']:+.3f} {span(figures['margin_q_ci'])} | {figures['binary_kl']:.3f} "
                     f"({figures['binary_kl_constant']:.3f}) | {ece_cells(figures)} |")
    results["trend"] = trend(results["runs"].values())
    lines.append(f"\nlog-linear trend of the margin: {results['trend']['per_doubling']:+.4f} per doubling of the training "
                 f"tokens; +0.05 predicted at {results['trend']['tokens_for_goal']} training tokens")
    results["table"] = lines
    plot_curve(results, Path(args.out) / "learning_curve.png")
    return results


def trend(runs: Any, goal: float = 0.05) -> dict[str, Any]:
    """The margin over q(ŷ) fitted as a + b·log2(training tokens) (least squares over the curve's sizes), and the
    training tokens at which that line reaches `goal` (None when it does not rise)."""
    runs = list(runs)
    x = np.log2([run["train_tokens"] for run in runs])
    y = np.array([run["margin_q"] for run in runs])
    slope, intercept = np.polyfit(x, y, 1)
    tokens = None if slope <= 0 else float(2 ** ((goal - intercept) / slope))
    return {"per_doubling": float(slope), "intercept": float(intercept), "goal": goal,
            "tokens_for_goal": None if tokens is None else round(tokens)}


def plot_curve(results: dict[str, Any], path: Path) -> None:
    """Margin over q(ŷ) and calibrated ECE at k = 1..3 against training tokens (log scale), with intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(results["runs"].values(), key=lambda run: run["train_tokens"])
    tokens = [run["train_tokens"] for run in runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    margin = np.array([run["margin_q"] for run in runs])
    low = np.array([run["margin_q_ci"][0] for run in runs])
    high = np.array([run["margin_q_ci"][1] for run in runs])
    left.errorbar(tokens, margin, yerr=[margin - low, high - margin], marker="o", capsize=3)
    left.axhline(0.05, color="grey", linestyle="--", label="goal +0.05")
    left.set(xscale="log", xlabel="training tokens", ylabel="AUC margin over q(ŷ)", title="held-out ranking")
    left.legend()
    for k in (1, 2, 3):
        ece = np.array([(run["ece"].get(k) or run["ece"][str(k)])[0] for run in runs])  # str keys once read back
        right.plot(tokens, ece, marker="o", label=f"k = {k}")
    right.axhline(0.03, color="grey", linestyle="--", label="goal 0.03")
    right.set(xscale="log", xlabel="training tokens", ylabel="cumulative ECE (calibrated)", title="calibration")
    right.legend()
    for axes in (left, right):
        axes.minorticks_off()
        axes.set_xticks(tokens, [f"{t / 1000:.1f}k" for t in tokens])
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def calibration_sizes(args: RecipeBenchmark) -> dict[str, Any]:
    """Refit the largest curve run's per-position maps on nested subsets of its calibration prompts; the held-out ECE
    per k with its interval shows how many calibration prompts the maps need."""
    from specheads.artifacts.checkpoint import load_trained
    from specheads.dataset.datamodule import AcceptanceDataModule
    from specheads.eval.offline import cumulative_calibration
    from specheads.heads.calibration_fit import fit_position_calibration

    largest = max(Path(args.out).glob("rows*"), key=lambda folder: int(folder.name[4:]))
    checkpoint = largest / "checkpoints" / "last.ckpt"
    trained = load_trained(str(checkpoint))
    draft = load_draft(args.data)
    held_out = score(checkpoint, args.data, draft, args.resamples)
    data = AcceptanceDataModule(args.data, val_fraction=args.val_fraction,
                                calibration_fraction=args.calibration_fraction, split_seed=args.split_seed)
    data.setup()
    data.splits["val"] = data.splits["calibration"]  # collect_tokens reads "val": score the calibration prompts
    from specheads.eval.offline import collect_tokens

    calibration_tokens = collect_tokens(trained, data, draft)
    prompts = np.random.default_rng(0).permutation(calibration_tokens.prompts)
    results: dict[str, Any] = {"checkpoint": str(checkpoint), "calibration_prompts": int(calibration_tokens.prompts),
                               "runs": {}}
    lines = ["| calibration prompts | ECE k=1 | k=2 | k=3 | k=4 | k=5 | k=6 |", "|---|---|---|---|---|---|---|"]
    sizes = [size for size in args.calibration_prompts if size <= calibration_tokens.prompts]
    for size in [0, *sizes]:
        if size:
            keep = np.isin(calibration_tokens.group, prompts[:size])
            rows = calibration_tokens.row[keep]
            mapping = fit_position_calibration(calibration_tokens.logit[keep], calibration_tokens.accept[keep], rows,
                                               calibration_tokens.position[keep], MAX_POSITIONS)
        else:
            mapping = None
        table = cumulative_calibration(held_out.table, mapping, MAX_POSITIONS, resamples=args.resamples)
        stage = "calibrated" if mapping is not None else "raw"
        ece = {row["k"]: [row["ece"], *(row["ece_ci"] or [None, None])] for row in table if row["stage"] == stage}
        results["runs"][str(size)] = ece
        lines.append(f"| {size or 'none (raw)'} | " + " | ".join(
            f"{ece[k][0]:.3f} [{ece[k][1]:.3f}, {ece[k][2]:.3f}]" for k in range(1, MAX_POSITIONS + 1)) + " |")
    results["table"] = lines
    return results


def slug(name: str) -> str:
    """A folder name for a run."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")[:60]


def main() -> None:
    args = parse_script(RecipeBenchmark, "benchmarks/head_recipe.py", __doc__)
    if args.step == "restate":
        restate(args)
        return
    steps = {"compare": compare, "curve": curve, "calibration": calibration_sizes}
    results = steps[args.step](args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out) / f"{args.step}.json", results)
    print("\n".join(results["table"]))


if __name__ == "__main__":
    sys.exit(main())
