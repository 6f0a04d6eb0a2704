"""Sibling-aware tree values offline (issue 51): how well a tree's later siblings are scored on held-out prompts.

On the second children of data labelled with `specheads gen --sibling_labels true` (by a derived draft or a feature
drafter, whose rounds its `depth` gives), at the prompts neither head trained
or calibrated on, three scores of the same second child x₂ (drawn from q without the drafted candidate):
- the chain head (the on-time head of drafted candidates, which a head-valued tree uses for every child),
- the sibling head (`configs/train/sibling-ontime.yaml`: trained on second children, `data.children: second`),
- draft confidence q(x₂) (the confidence-valued tree's score of a sampled child),
against its label min(1, p₂/q₂), the chance the target accepts it once the drafted candidate was rejected. A tree
checks the second child at depth k only when the first children at depths 1..k−1 were accepted and the one at depth k
was rejected, so depth k's figures weigh every run of k drafted positions by Π first_accept before × (1 − first_accept)
there (`heads.calibration_fit.fit_sibling_calibration`'s weights); each head is read through its calibration map of depth
k, as the tree reads it. Figures: weighted soft AUC, mean score − mean label (how much the score overstates the
sibling), weighted ECE and binary KL, with 95 % intervals over prompts (paired for the differences).

    python benchmarks/sibling_values.py --data runs/gen/smollm2-demo-siblings \
        --head runs/train/ontime-16x/checkpoints/last.ckpt --sibling-head runs/train/sibling-ontime/checkpoints/last.ckpt \
        --out runs/siblings/offline.json
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specheads.plumbing.dataclass_cli import parse_script  # noqa: E402
from specheads.plumbing.files import write_json_atomic  # noqa: E402

SCORERS = ("chain_head", "sibling_head", "confidence")


@dataclass
class Config:
    """What to compare.

    Args:
        data: a `specheads gen --sibling_labels true` folder of the heads' pair.
        head: the chain head (`.ckpt` or head folder) a head-valued tree scores first children with.
        sibling_head: the head trained on second children (`data.children: second`).
        out: the results JSON.
        depths: tree depths k = 1..depths.
        bins: bins of the calibration error.
        resamples: bootstrap resamples over prompts.
        seed: seed of the bootstrap.
    """

    data: str
    head: str
    sibling_head: str
    out: str = "runs/siblings/offline.json"
    depths: int = 3
    bins: int = 10
    resamples: int = 500
    seed: int = 0


def weighted_metrics(label: np.ndarray, score: np.ndarray, weight: np.ndarray, bins: int) -> dict[str, float]:
    """Weighted soft AUC (each token a positive of weight w·a and a negative of weight w·(1 − a)), mean score − mean
    label, ECE over equal-width bins and binary KL (weighted means); NaN where the weights leave no positive or no
    negative mass (AUC) or no mass at all."""
    from specheads.artifacts.metrics import binary_kl, expected_calibration_error, soft_auc

    if weight.sum() <= 0:
        return dict.fromkeys(("auc", "overstates_by", "ece", "binary_kl", "mean_label"), float("nan"))
    return {"auc": soft_auc(label, score, weight), "overstates_by": float(np.average(score - label, weights=weight)),
            "ece": expected_calibration_error(label, score, bins, weight), "binary_kl": binary_kl(label, score, weight),
            "mean_label": float(np.average(label, weights=weight))}


def collect(config: Config) -> dict[str, Any]:
    """Per token of the held-out second children: both heads' logits, q(x₂), the label, the first child's acceptance,
    and the token's prompt, row and position."""
    import torch

    from specheads.artifacts.checkpoint import load_trained
    from specheads.dataset.datamodule import AcceptanceDataModule
    from specheads.eval.offline import collect_tokens
    from specheads.train.draft import load_draft

    chain, sibling = load_trained(config.head), load_trained(config.sibling_head)
    if sibling.children != "second" or chain.children != "first":
        raise SystemExit("sibling_values.py: --head must score drafted candidates and --sibling-head second children "
                         f"(data.children: second); got {chain.children} and {sibling.children}")
    held = set()
    for trained in (chain, sibling):
        if trained.used_prompts is None:
            raise SystemExit(f"sibling_values.py: {trained.source} records no training prompts; train it again")
        held |= trained.used_prompts
    data = AcceptanceDataModule(config.data, children="second")
    data.split_by_trained_prompts(held)
    if not len(data.splits["val"]):
        raise SystemExit(f"sibling_values.py: every prompt of {config.data} trained or calibrated one of the heads; give "
                         "data with prompts neither saw")
    draft = load_draft(data.manifest)
    with torch.no_grad():
        tables = {name: collect_tokens(trained, data, draft) for name, trained in (("chain", chain), ("sibling", sibling))}
    first = np.concatenate([batch["first_accept"][batch["valid"] & batch["is_draft"]].numpy()
                            for batch in data.ordered_batches("val", with_features=False)]).astype(np.float64)
    table = tables["sibling"]
    assert np.array_equal(table.label, tables["chain"].label) and len(first) == len(table.label)
    return {"heads": {"chain": chain.head, "sibling": sibling.head}, "logits": {k: t.logit for k, t in tables.items()},
            "label": table.label, "confidence": np.exp(table.logq), "first": first, "group": table.group,
            "row": table.row, "position": table.position, "depth": table.depth, "prompts": table.prompts}


def compare(tokens: dict[str, Any], config: Config) -> dict[str, Any]:
    """Per depth: each scorer's weighted metrics with intervals over prompts, and the sibling head's paired
    differences against the others."""
    from specheads.heads.calibration import round_windows, sigmoid

    windows = round_windows(tokens["row"], tokens["position"], config.depths, tokens.get("depth"))  # a drafter's rounds
    rng = np.random.default_rng(config.seed)
    results = []
    for k, index in enumerate(windows, start=1):
        if not len(index):
            break  # no run of k drafted positions: none deeper either
        last = index[:, -1]
        weight = tokens["first"][index[:, :-1]].prod(axis=1) * (1 - tokens["first"][last])
        label, group = tokens["label"][last], tokens["group"][last]
        scores = {"confidence": tokens["confidence"][last]}
        for name in ("chain", "sibling"):
            head, logit = tokens["heads"][name], tokens["logits"][name][last]
            calibrated = head.calibration.logits(logit, np.full(len(logit), k)) if head.calibration else logit
            scores[f"{name}_head"] = sigmoid(calibrated)
        row = {"depth": k, "second_children": int(len(last)), "weight": float(weight.sum()),
               "scorers": {name: weighted_metrics(label, scores[name], weight, config.bins) for name in SCORERS}}
        prompts = np.unique(group)
        members = {g: np.flatnonzero(group == g) for g in prompts}
        draws = {name: {metric: [] for metric in ("auc", "overstates_by")} for name in SCORERS}
        for _ in range(config.resamples):
            chosen = np.concatenate([members[g] for g in rng.choice(prompts, len(prompts))])
            for name in SCORERS:
                figures = weighted_metrics(label[chosen], scores[name][chosen], weight[chosen], config.bins)
                for metric in draws[name]:
                    draws[name][metric].append(figures[metric])
        for name in SCORERS:
            for metric, values in draws[name].items():
                row["scorers"][name][f"{metric}_ci"] = [float(np.nanpercentile(values, q)) for q in (2.5, 97.5)]
        row["sibling_head_minus"] = {
            other: {metric: [float(np.nanpercentile(np.subtract(draws["sibling_head"][metric], draws[other][metric]), q))
                             for q in (2.5, 97.5)] for metric in ("auc", "overstates_by")}
            for other in ("chain_head", "confidence")}
        results.append(row)
    return {"data": config.data, "head": config.head, "sibling_head": config.sibling_head, "prompts": tokens["prompts"],
            "depths": results}


def main() -> None:
    config = parse_script(Config, "sibling_values.py", __doc__.splitlines()[0])
    results = compare(collect(config), config)
    write_json_atomic(Path(config.out), results)
    print(f"held-out prompts: {results['prompts']}")
    print("| depth | second children (weight) | scorer | AUC [95 %] | score − accepted [95 %] | ECE | binary KL |")
    print("|---|---|---|---|---|---|---|")
    for row in results["depths"]:
        for name in SCORERS:
            m = row["scorers"][name]
            print(f"| {row['depth']} | {row['second_children']} ({row['weight']:.0f}) | {name} | {m['auc']:.3f} "
                  f"[{m['auc_ci'][0]:.3f}, {m['auc_ci'][1]:.3f}] | {m['overstates_by']:+.3f} "
                  f"[{m['overstates_by_ci'][0]:+.3f}, {m['overstates_by_ci'][1]:+.3f}] | {m['ece']:.3f} | "
                  f"{m['binary_kl']:.3f} |")
        for other, diff in row["sibling_head_minus"].items():
            print(f"depth {row['depth']}: sibling head − {other}: AUC [{diff['auc'][0]:+.3f}, {diff['auc'][1]:+.3f}], "
                  f"overstatement [{diff['overstates_by'][0]:+.3f}, {diff['overstates_by'][1]:+.3f}]")


if __name__ == "__main__":
    main()
