"""Decisions that transfer (issues 53, 62): the on-time head's stop rule read from the costs, on the head as trained
(`head_cost`) and on the head calibrated while serving (`head_cost_online`), both tuned nowhere, against the free
rules with thresholds tuned on one prompt family and tested on the others, per family, at c = 0.05, 0.2 and 0.5.

Steps, each resumable (a setting whose records exist is not decoded again); `--shard i/n` splits a step's settings
between processes (two on the 2-core machine, one torch thread each):

    # every free rule's grid (and the head's tuned rule) on the dev prompts, `--dev-per-family` of each family
    python benchmarks/transfer.py --step tune --head H --out runs/transfer
    # on the confirmation prompts: each threshold some family's tuning chose at some c, transformers' default, and
    # head_cost and head_cost_online at each c
    python benchmarks/transfer.py --step confirm --head H --out runs/transfer
    # the tables: per c and held-out family, each rule tuned nowhere against each free rule tuned on every other family
    python benchmarks/transfer.py --step report --out runs/transfer

A family is a prompt's `category` (chat, explanation, code, math, summarisation). Thresholds are tuned per family
and c on the dev prompts (heldout_decode.jsonl) by the modelled speedup; the figures are on the confirmation prompts
(heldout_confirm.jsonl), which nothing was tuned on. Prompt i of a file is decoded with seed i under every setting,
so every comparison is paired by prompt. Counts, not times: speedup = tokens ÷ (c · draft forwards + target calls).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specheads.eval.offline import interval  # noqa: E402
from specheads.eval.sweep import modelled_speedup  # noqa: E402
from specheads.plumbing.dataclass_cli import parse_script  # noqa: E402
from specheads.plumbing.files import write_json_atomic  # noqa: E402

POOLED = "all"
"""The tuning source of the in-distribution table: every family's dev prompts together."""
FREE_RULES = ("constant_k", "confidence", "adaedl", "sglang_adaptive", "vllm_online", "vllm_current", "vllm_margin", "pmin")
"""The free rules tuned per family (the strongest of issue 34's table, with AdaEDL, SGLang's EMA of accepted lengths
and vLLM's online acceptance estimators as the run-time adapted ones: its older form, its merged form on logit(max q)
and its margin revision; and llama.cpp's p_min); a rule whose tune records are missing is left out of the tables."""
GRIDS = {"constant_k": "constant_ks", "confidence": "confidence", "adaedl": "adaedl", "sglang_adaptive": "sglang_adaptive",
         "vllm_online": "vllm_online", "vllm_current": "vllm_current", "vllm_margin": "vllm_margin", "pmin": "pmin",
         "head": "head_thresholds"}
"""The `Config` field that holds each tuned rule's grid."""
TUNED_NOWHERE = ("head_cost", "head_cost_online")
"""The rules read from the costs, decoded at each c (their value) and judged against the free rules: on the head as
trained, and on the head calibrated online from verify outcomes (`specheads.decoding.calibration`)."""


@dataclass
class Config:
    """What to decode.

    Args:
        step: tune (grids on dev prompts), confirm (the reported runs) or report (the tables).
        head: the trained on-time head (`.ckpt` or head folder), calibrated per position.
        out: folder of the records and results.json.
        shard: `i/n`: this process decodes every n-th setting from the i-th.
        threads: torch CPU threads (0: torch's default).
        dev_file: JSONL of the dev prompts, with a `category` per prompt.
        dev_per_family: dev prompts per family that tune.
        test_per_family: confirmation prompts per family that report (all when not given).
        policies: decode only these policies' settings of the step (all when not given): the free rules' runs need no
            head, so they can run before the head is trained.
        test_file: JSONL of the confirmation prompts, with a `category` per prompt.
        max_new_tokens: tokens per run.
        max_draft: the most candidates of a round, for every rule.
        batch_size: rows decoded together (continuous batching).
        cost_ratios: the c at which rules are tuned and judged (head_cost is decoded at each).
        constant_ks: constant K's grid.
        confidence: draft confidence's grid (stop when q(ŷ) < h).
        adaedl: AdaEDL's grid of starting λ.
        sglang_adaptive: SGLang's adaptive rule's grid of starting K (it then moves among 1, 3, 7 at run time).
        vllm_online: vLLM's older online estimator's grid of h (end the round once 1 − Π of its acceptance estimates
            > h).
        vllm_current: vLLM's merged estimator's grid of h (on logit(max q), no warm-up).
        vllm_margin: vLLM's estimator on the top-2 margin's grid of h (full blocks until its third refit).
        pmin: llama.cpp's p_min grid (the round ends, unchecked, at the first candidate with max q below it).
        head: the head's tuned stop rule's grid (1 − Π â > h), for reference.
        transformers_default: decode transformers' untuned default (confidence 0.4, ROC-retuned) on the test prompts.
        report_on: the prompts the report step's tables rest on: the confirmation prompts, or the dev prompts (each
            family held out of the tuning it is judged against; its in-family column was tuned on those very
            prompts, so only the columns tuned on other families are a transfer figure).
        resamples: bootstrap resamples of the paired intervals.
    """

    step: Literal["tune", "confirm", "report"] = "report"
    head: str | None = None
    out: str = "runs/transfer"
    shard: str = "0/1"
    threads: int = 0
    dev_file: str = str(ROOT / "benchmarks" / "prompts" / "heldout_decode.jsonl")
    dev_per_family: int = 10
    test_per_family: int | None = None
    policies: list[str] | None = None
    test_file: str = str(ROOT / "benchmarks" / "prompts" / "heldout_confirm.jsonl")
    max_new_tokens: int = 24
    max_draft: int = 8
    batch_size: int = 32
    cost_ratios: list[float] = field(default_factory=lambda: [0.05, 0.2, 0.5])
    constant_ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6])
    confidence: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.34, 0.5, 0.7])
    adaedl: list[float] = field(default_factory=lambda: [0.2, 0.36, 0.5, 0.6, 0.7])
    sglang_adaptive: list[int] = field(default_factory=lambda: [1, 3, 7])
    vllm_online: list[float] = field(default_factory=lambda: [0.15, 0.3, 0.45, 0.6, 0.75])
    vllm_current: list[float] = field(default_factory=lambda: [0.15, 0.3, 0.45, 0.6, 0.75])
    vllm_margin: list[float] = field(default_factory=lambda: [0.15, 0.3, 0.45, 0.6, 0.75])
    pmin: list[float] = field(default_factory=lambda: [0.3, 0.5, 0.65, 0.8, 0.9])
    head_thresholds: list[float] = field(default_factory=lambda: [0.45, 0.6, 0.75])
    transformers_default: bool = True
    report_on: Literal["confirm", "dev"] = "confirm"
    resamples: int = 2000


def grid(config: Config) -> list[tuple[str, float]]:
    """The tuned rules' settings (policy and threshold, K for constant K), and the rules tuned nowhere at each c."""
    return ([(policy, float(t)) for policy, name in GRIDS.items() for t in getattr(config, name)]
            + [(rule, c) for rule in TUNED_NOWHERE for c in config.cost_ratios])


def setting_name(policy: str, threshold: float) -> str:
    return f"{policy}-{threshold:g}"


def prompt_rows(path: str) -> list[dict[str, Any]]:
    """The JSONL's rows (id, category, prompt), in file order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def first_per_family(path: str, per_family: int | None) -> list[dict[str, Any]]:
    """The first `per_family` prompts of each family in `path` (all of them when None), each with its index in the
    file as its seed."""
    taken: dict[str, int] = {}
    rows = []
    for index, row in enumerate(prompt_rows(path)):
        if per_family is None or taken.get(row["category"], 0) < per_family:
            taken[row["category"]] = taken.get(row["category"], 0) + 1
            rows.append({**row, "seed": index})
    return rows


def dev_rows(config: Config) -> list[dict[str, Any]]:
    return first_per_family(config.dev_file, config.dev_per_family)


def test_rows(config: Config) -> list[dict[str, Any]]:
    return first_per_family(config.test_file, config.test_per_family)


def load_records(folder: Path) -> dict[tuple[str, float], list[dict[str, Any]]]:
    """Every decoded setting's records in `folder`."""
    return {setting: payload["records"] for setting, payload in load_settings(folder).items()}


def load_settings(folder: Path) -> dict[tuple[str, float], dict[str, Any]]:
    """Every decoded setting's file in `folder`: its records and, for a rule whose estimate refits while serving, how
    often it refitted."""
    found = {}
    for path in sorted(folder.glob("*.json")):
        payload = json.loads(path.read_text())
        found[(payload["policy"], float(payload["threshold"]))] = payload
    return found


def unrefitted(folder: Path) -> list[str]:
    """The settings in `folder` whose estimate, refitted every 100 rounds while serving, never refitted: they ran on
    their starting estimate throughout (head_cost_online on the head's own calibration, as head_cost)."""
    return [setting_name(*setting) for setting, payload in load_settings(folder).items() if payload.get("refits") == 0]


def totals(records: list[dict[str, Any]]) -> np.ndarray:
    """[prompts, 3]: emitted, draft forwards (the head's forwards at their cost included), target calls."""
    refuse_uncharged(records)
    return np.array([[r["emitted"], r["draft_forwards"] + r["head_forwards"], r["target_calls"]] for r in records],
                    dtype=float)


def refuse_uncharged(records: list[dict[str, Any]]) -> None:
    """Stop at records decoded before the head's forwards were counted: their speedups count the head free."""
    if any("head_forwards" not in r for r in records):
        raise SystemExit("transfer.py: these records were decoded before the head's forwards were counted (no "
                         "head_forwards); remove them and decode again")


def speedup(table: np.ndarray, cost_ratio: float) -> np.ndarray:
    """Modelled speedup over summed prompts (`table` may carry a leading resample axis)."""
    return modelled_speedup(table[..., 0].sum(-1), table[..., 1].sum(-1), table[..., 2].sum(-1), cost_ratio)


def family_of(records: list[dict[str, Any]], family: str) -> list[dict[str, Any]]:
    return sorted((r for r in records if r["family"] == family), key=lambda r: r["prompt"])


def tuned_thresholds(config: Config) -> dict[str, dict[str, dict[str, float]]]:
    """{c: {policy: {family: the dev threshold of the highest modelled speedup on that family's dev prompts}}}, and
    under POOLED the one of all families' dev prompts together."""
    decoded = load_records(Path(config.out) / "tune")
    families = sorted({r["category"] for r in dev_rows(config)})
    tuned: dict[str, dict[str, dict[str, float]]] = {}
    for c in config.cost_ratios:
        for policy in (*FREE_RULES, "head"):
            options = [(threshold, records) for (p, threshold), records in decoded.items() if p == policy]
            if not options:
                continue
            tuned.setdefault(f"{c:g}", {})[policy] = {
                family: max(options, key=lambda item: float(speedup(totals(family_of(item[1], family)), c)))[0]
                for family in families}
            tuned[f"{c:g}"][policy][POOLED] = max(options, key=lambda item: float(speedup(totals(item[1]), c)))[0]
    return tuned


def settings(config: Config, step: str) -> list[tuple[str, float]]:
    """The settings a step decodes."""
    if step == "tune":
        return grid(config)
    chosen = {(policy, threshold) for by_policy in tuned_thresholds(config).values()
              for policy, by_family in by_policy.items() for threshold in by_family.values()}
    extra = [(rule, c) for rule in TUNED_NOWHERE for c in config.cost_ratios]
    if config.transformers_default:
        extra.append(("transformers", 0.4))
    return extra + sorted(chosen)


def decode(config: Config, step: str) -> None:
    """Decode this shard's settings of `step`, one records file per setting."""
    import torch

    from specheads.artifacts.checkpoint import load_trained
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.decoding import RoundEngine, make_policy
    from specheads.model_outputs.sampling import SamplingTransform
    from specheads.pair.models import ModelSpec, load_pair, stop_token_ids

    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.out) / step
    index, count = (int(part) for part in config.shard.split("/"))
    todo = [s for i, s in enumerate(settings(config, step)) if i % count == index
            and not (out / f"{setting_name(*s)}.json").exists() and (config.policies is None or s[0] in config.policies)]
    if not todo:
        return
    pair = load_pair(ModelSpec(path="embedded:smollm2"), ModelSpec(path=None, skip_layers=[20, 21]))
    head = load_trained(config.head).head
    rows = dev_rows(config) if step == "tune" else test_rows(config)
    by_id = {p.id: p for p in load_prompts(config.dev_file if step == "tune" else config.test_file)}
    prompts = [encode_prompt(pair.tokenizer, by_id[row["id"]]) for row in rows]
    seeds = [row["seed"] for row in rows]
    engine = RoundEngine(pair.target, pair.draft, SamplingTransform(1.0), stop_token_ids(pair.target, pair.tokenizer))
    for policy, threshold in todo:
        rule = make_policy(policy, threshold, max_draft=config.max_draft)
        planner = rule.planner(None)
        results = engine.decode(prompts, rule, config.max_new_tokens, seeds, head if rule.reads_head else None,
                                batch_size=config.batch_size, planner=planner)
        fit = getattr(getattr(planner, "signal", None), "fit", None)  # an estimate refitted while serving
        records = [{"prompt": row["id"], "family": row["category"], "emitted": r.emitted, "accepted": r.accepted,
                    "drafted": r.drafted, "draft_forwards": r.draft_forwards, "head_forwards": r.head_forwards,
                    "target_calls": r.target_calls}
                   for row, r in zip(rows, results)]
        write_json_atomic(out / f"{setting_name(policy, threshold)}.json",
                          {"policy": policy, "threshold": threshold, "records": records,
                           **({"refits": fit.refits} if fit is not None else {})})
        print(step, setting_name(policy, threshold), round(float(speedup(totals(records), 0.2)), 3), flush=True)


def gain(mine: np.ndarray, theirs: np.ndarray, cost_ratio: float, draws: np.ndarray) -> list[float]:
    """[point, low, high] of mine's modelled speedup over theirs, minus 1, paired over prompts."""
    point = float(speedup(mine, cost_ratio) / speedup(theirs, cost_ratio) - 1)
    return [point, *interval(list(speedup(mine[draws], cost_ratio) / speedup(theirs[draws], cost_ratio) - 1))]


def report(config: Config) -> None:
    """results.json and the tables (module docstring): for each rule tuned nowhere whose runs exist, per c and
    held-out family, its gain over each free rule at the threshold another family chose."""
    out = Path(config.out)
    tuned = tuned_thresholds(config)
    test = load_records(out / ("confirm" if config.report_on == "confirm" else "tune"))
    families = sorted({r["category"] for r in (test_rows if config.report_on == "confirm" else dev_rows)(config)})
    judged = [rule for rule in TUNED_NOWHERE if all((rule, c) in test for c in config.cost_ratios)]
    results: dict[str, Any] = {"tuned": tuned, "rows": [], "pooled": []}
    rng = np.random.default_rng(0)
    for rule in judged:
        for c in config.cost_ratios:
            key = f"{c:g}"
            # a rule added to FREE_RULES after an out folder's steps ran is left out until tune and confirm decode it
            rules = [p for p in (*FREE_RULES, "head") if p in tuned[key] and all((p, t) in test for t in tuned[key][p].values())]
            print(f"\n### {rule}, c = {key}\n")
            print(f"| held-out family | {rule} (tuned nowhere) | " + " | ".join(
                f"{p}: tuned in-family / best tuned on another / {rule}'s gain over that [95 %]"
                for p in rules) + " | transformers' default |")
            print("|---|---|" + "---|" * (len(rules) + 1))
            for family in families:
                row = family_row(config, test, tuned[key], rule, c, family, rules, rng)
                results["rows"].append(row)
                print(f"| {family} | " + " | ".join(row.pop("cells")) + " |")
            results["pooled"].append(pooled_row(config, test, tuned[key], rule, c, rules, rng))
    results["unrefitted"] = unrefitted(out / ("confirm" if config.report_on == "confirm" else "tune"))
    if results["unrefitted"]:
        print(f"\nNever refitted (fewer than 100 rounds a setting; decode more rounds: longer --max-new-tokens, a "
              f"smaller --batch-size): {', '.join(results['unrefitted'])}.")
    write_json_atomic(out / f"results-{config.report_on}.json", results)


def family_row(config: Config, test: dict[tuple[str, float], list[dict[str, Any]]], tuned: dict[str, dict[str, float]],
               rule: str, c: float, family: str, rules: list[str], rng: np.random.Generator) -> dict[str, Any]:
    """One held-out family's row at c: `rule`'s modelled speedup, and per free rule its speedup tuned in-family, the
    best tuned on another family and `rule`'s paired gains over both (`cells`: the printed table's)."""
    mine = totals(family_of(test[(rule, c)], family))
    draws = rng.integers(0, len(mine), (config.resamples, len(mine)))
    row: dict[str, Any] = {"rule": rule, "c": c, "family": family, "speedup": float(speedup(mine, c)), "rules": {}}
    cells = [f"{row['speedup']:.3f}×"]
    for policy in rules:
        chosen = tuned[policy]
        by_source = {source: totals(family_of(test[(policy, threshold)], family))
                     for source, threshold in chosen.items() if source != POOLED}
        others = {source: float(speedup(table, c)) for source, table in by_source.items() if source != family}
        strongest = max(others, key=others.__getitem__)
        versus = gain(mine, by_source[strongest], c, draws)
        in_family = float(speedup(by_source[family], c))
        row["rules"][policy] = {"in_family": in_family, "in_family_threshold": chosen[family],
                                "strongest_other_source": strongest, "strongest_other": others[strongest],
                                "strongest_other_threshold": chosen[strongest], "others": others,
                                "gain_over_strongest_other": versus,
                                "gain_over_in_family": gain(mine, by_source[family], c, draws)}
        cells.append(f"{in_family:.3f} / {others[strongest]:.3f} ({strongest}, {chosen[strongest]:g}) / "
                     f"{100 * versus[0]:+.1f} % [{100 * versus[1]:+.1f}, {100 * versus[2]:+.1f}]")
    if ("transformers", 0.4) in test:
        theirs = totals(family_of(test[("transformers", 0.4)], family))
        row["transformers"] = float(speedup(theirs, c))
        row["gain_over_transformers"] = gain(mine, theirs, c, draws)
        cells.append(f"{row['transformers']:.3f}×")
    else:
        cells.append("–")
    return {**row, "cells": cells}


def pooled_row(config: Config, test: dict[tuple[str, float], list[dict[str, Any]]], tuned: dict[str, dict[str, float]],
               rule: str, c: float, rules: list[str], rng: np.random.Generator) -> dict[str, Any]:
    """The in-distribution comparison at c over every test prompt: `rule` (tuned nowhere) and each free rule at the
    threshold all families' dev prompts chose together, with `rule`'s paired gain over each (printed as a table)."""
    by_prompt = sorted(test[(rule, c)], key=lambda r: (r["family"], r["prompt"]))
    mine = totals(by_prompt)
    draws = rng.integers(0, len(mine), (config.resamples, len(mine)))
    row: dict[str, Any] = {"rule": rule, "c": c, "speedup": float(speedup(mine, c)), "rules": {}}
    print(f"\nAll {len(mine)} test prompts, each rule at the threshold all families' dev prompts chose together:\n")
    print(f"| rule | threshold | modelled speedup | {rule}'s gain over it [95 % paired] |")
    print("|---|---|---|---|")
    print(f"| {rule} (tuned nowhere) | c = {c:g} | {row['speedup']:.3f}× | – |")
    for policy in rules:
        threshold = tuned[policy].get(POOLED)
        if (policy, threshold) not in test:
            continue
        theirs = totals(sorted(test[(policy, threshold)], key=lambda r: (r["family"], r["prompt"])))
        versus = gain(mine, theirs, c, draws)
        row["rules"][policy] = {"threshold": threshold, "speedup": float(speedup(theirs, c)), "gain": versus}
        print(f"| {policy} | {threshold:g} | {row['rules'][policy]['speedup']:.3f}× | "
              f"{100 * versus[0]:+.1f} % [{100 * versus[1]:+.1f}, {100 * versus[2]:+.1f}] |")
    return row


def main() -> None:
    config = parse_script(Config, "transfer.py", __doc__.splitlines()[0])
    if config.step == "report":
        report(config)
        return
    if config.head is None:
        raise SystemExit("transfer.py: --head is required for the tune and confirm steps; give the on-time head's .ckpt")
    if config.step == "confirm" and not (Path(config.out) / "tune").is_dir():
        raise SystemExit("transfer.py: no tune/ records in --out; run --step tune first")
    decode(config, config.step)


if __name__ == "__main__":
    main()
