"""Heads from logs against a head on full labels (issue 72, item 3): the same prompts, the same recipe, the same
held-out tokens (`specheads.train.lookup_bias`).

1. Logs: each running rule decodes the greedy responses of `--labels` (gen at T = 0) in a replay with no forward, its
   proposer reading `--max-draft` tokens a round, and the replay is written as our decoder's round log
   (`<out>/logs/<rule>.jsonl`): the labels' training prompts first, then their validation prompts, each request
   carrying its prompt's id, so the logs split by prompt exactly as the labels do.
2. Heads (the recipe `--config`, e.g. configs/train/lookup-stop.yaml: its model, trainer and split): `full` on the
   labels' training split, and per running rule `<rule>/skip` (the survival likelihood) and `<rule>/reject`
   (unverified positions read as rejections) on its log's training split (`specheads train lookup from-logs fit`);
   with `--log-steps N` those train N optimiser steps (the full head's count) instead of the recipe's epochs. A rule
   that verifies every proposed token (constant_k at `--max-draft`) is the control: nothing censored, so what its
   head loses to `full` is what a log's round starts lack against gen's labels of every output position.
3. AUC of every head on the labels' validation split (all depths, depth <= 8, depth > 8), its difference from
   `full`'s with a bootstrap interval over prompts (`<out>/auc.json`).
4. Counted speed: each head's `--rule` replayed on `--confirm` greedy responses, forwards priced by the verify curve of
   `--verify-curve` (counted, not a wall clock), paired per prompt against `full` (`<out>/speed.json`).

Every step resumes: a log, head or JSON already written is read, not made again.

    python benchmarks/lookup_from_logs.py --labels runs/lookup2/gen-dev-t0 --confirm runs/lookup/gen-confirm24-t0 \
        --config configs/train/lookup-stop.yaml --verify-curve runs/lookup2/wallclock-t0.json \
        --running lookup_table:0.043 --running constant_k:8 --running constant_k:32 --out runs/from-logs [--log-steps 2520]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from lookup_replay import read_curve

from specheads.dataset.datamodule import prompt_split
from specheads.dataset.lookup import load_lookup
from specheads.dataset.store import read_manifest
from specheads.decoding.free_replay import greedy_refusal, make_rule
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic, write_text_atomic
from specheads.train.cli import main as train_main
from specheads.train.lookup_bias import head_predictions, held_out_tokens, paired_speed, replayed_log, sliced_aucs

UNOBSERVED = ("skip", "reject")


def greedy_rows(labels: str) -> list[dict[str, Any]]:
    """The labels' (prompt_id, prompt_ids, target_ids), refused unless labelled at T = 0."""
    refusal = greedy_refusal(read_manifest(Path(labels)), labels)
    if refusal:
        raise UsageError(refusal)
    return list(load_lookup(labels).select_columns(["prompt_id", "prompt_ids", "target_ids"]))


def write_logs(rows: list[dict[str, Any]], rules: list[str], recipe: dict[str, Any], max_draft: int, curve: Any,
               out: Path) -> dict[str, Path]:
    """Each running rule's round log (module docstring, step 1), by rule."""
    split = {row["prompt_id"]: prompt_split(row["prompt_id"], recipe["split_seed"], recipe["val_fraction"])
             for row in rows}
    ordered = sorted(rows, key=lambda row: split[row["prompt_id"]] == "val")  # stable: training prompts first
    logs = {}
    for rule in rules:
        logs[rule] = out / "logs" / f"{rule.replace(':', '-')}.jsonl"
        if not logs[rule].is_file():
            lines = replayed_log(ordered, rule, max_draft, curve)
            write_text_atomic(logs[rule], "".join(json.dumps(line) + "\n" for line in lines))
    return logs


def train_head(argv: list[str], folder: Path) -> str:
    """The head a `specheads train` fit exports to `folder/head`, fitted unless there (resumed from its last
    checkpoint where one is)."""
    head = folder / "head"
    if not (head / "config.json").is_file():
        resume = ["--ckpt_path", "last"] if (folder / "checkpoints" / "last.ckpt").is_file() else []
        code = train_main([*argv, "--trainer.default_root_dir", str(folder), "--trainer.enable_progress_bar", "false",
                           *resume])
        if code:
            raise UsageError(f"training {folder} exited {code}; see its log above")
    return str(head)


def train_heads(labels: str, config: str, logs: dict[str, Path], out: Path, log_steps: int | None) -> dict[str, str]:
    """The heads of step 2, by name; the logs' recipe is `config`'s model and trainer with its data split (and
    `log_steps` optimiser steps where given, as many as the full head's: the logs hold fewer positions, so an epoch
    has fewer steps)."""
    recipe = yaml.safe_load(Path(config).read_text())
    data = {key: recipe["data"][key] for key in ("val_fraction", "split_seed", "batch_size")}
    logs_config = out / "configs" / "from-logs.yaml"
    write_text_atomic(logs_config, yaml.safe_dump({"model": recipe["model"], "trainer": recipe["trainer"],
                                                   "data": data}))
    heads = {"full": train_head(["lookup", "fit", "--config", config, "--data.path", labels], out / "heads" / "full")}
    steps = [] if log_steps is None else ["--trainer.max_steps", str(log_steps), "--trainer.max_epochs", "100000"]
    for rule, log in logs.items():
        for unobserved in UNOBSERVED:
            name = f"{rule}/{unobserved}" + ("" if log_steps is None else f"/{log_steps}-steps")
            heads[name] = train_head(["lookup", "from-logs", "fit", "--config", str(logs_config), "--data.logs",
                                      json.dumps([str(log)]), "--data.unobserved", unobserved, *steps],
                                     out / "heads" / name.replace(":", "-"))
    return heads


def cached(path: Path, heads: dict[str, str], make: Any) -> dict[str, Any]:
    """The JSON at `path` where it judged `heads`, else made (and written atomically)."""
    if path.is_file() and json.loads(path.read_text()).get("heads") == heads:
        return json.loads(path.read_text())
    found = {**make(), "heads": heads}
    write_json_atomic(path, found)
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", required=True, help="gen's lookup labels at T = 0 (full labels, greedy responses)")
    parser.add_argument("--confirm", required=True, help="lookup labels at T = 0 of other prompts (the counted speed)")
    parser.add_argument("--config", required=True, help="the head recipe, e.g. configs/train/lookup-stop.yaml")
    parser.add_argument("--verify-curve", required=True, help="a benchmarks/lookup_decode.py results JSON")
    parser.add_argument("--running", action="append", required=True, help="a running rule, name:value (repeatable)")
    parser.add_argument("--rule", default="lookup_plan:0.043", help="the rule each head drives in the counted replay")
    parser.add_argument("--max-draft", type=int, default=32, help="tokens the proposer reads a round")
    parser.add_argument("--log-steps", type=int, help="optimiser steps of the heads from logs (default: the recipe's "
                        "epochs)")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples over prompts")
    parser.add_argument("--out", default="runs/from-logs")
    args = parser.parse_args(argv)
    curve = read_curve(args.verify_curve)
    for rule in args.running:
        make_rule(rule, args.max_draft, None, curve)
    recipe = yaml.safe_load(Path(args.config).read_text())["data"]
    out = Path(args.out)
    rows, confirm = greedy_rows(args.labels), greedy_rows(args.confirm)
    logs = write_logs(rows, args.running, recipe, args.max_draft, curve, out)
    heads = train_heads(args.labels, args.config, logs, out, args.log_steps)
    suffix = "" if args.log_steps is None else f"-{args.log_steps}-steps"
    tokens = held_out_tokens(args.labels, recipe["val_fraction"], recipe["split_seed"])
    auc = cached(out / f"auc{suffix}.json", heads,
                 lambda: sliced_aucs(head_predictions(heads, tokens["features"]), tokens, "full", args.resamples))
    responses = [(row["prompt_ids"], row["target_ids"]) for row in confirm]
    speed = cached(out / f"speed{suffix}.json", heads,
                   lambda: paired_speed(responses, heads, "full", args.rule, args.max_draft, curve, args.resamples))
    show(auc, speed)
    return 0


def show(auc: dict[str, Any], speed: dict[str, Any]) -> None:
    """The AUC slices and the counted speed ratios, a line each."""
    for part, row in auc["slices"].items():
        print(f"AUC {part} ({row['tokens']} tokens): " + ", ".join(
            f"{name} {v['auc']:.4f} ({v['minus_baseline']:+.4f} [{v['interval'][0]:+.4f}, {v['interval'][1]:+.4f}])"
            for name, v in row.items() if name != "tokens"))
    print("counted speed / full: " + ", ".join(f"{name} {v['speedup']:.4f} [{v['interval'][0]:.4f}, "
                                               f"{v['interval'][1]:.4f}]" for name, v in speed["ratio"].items()))

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
