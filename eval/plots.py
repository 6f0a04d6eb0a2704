"""The report's PNG plots: ROC with every baseline, reliability diagram, Pareto frontier, accepted lengths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
from sklearn.metrics import roc_curve  # noqa: E402

from specheads.eval.offline import SIGNAL_ORDER, TokenTable  # noqa: E402
from specheads.plumbing.files import atomic_path  # noqa: E402

PLOTS = {"roc": "roc.png", "reliability": "reliability.png", "cumulative_reliability": "cumulative_reliability.png",
         "pareto": "pareto.png", "acceptance_lengths": "acceptance_lengths.png", "serving": "serving.png"}
LABELS = {"head": "learned head", "svip_entropy": "SVIP −√H(q)", "draft_top1": "draft top-1 prob",
          "draft_prob": "draft q(ŷ)", "vllm_online": "vLLM online estimator (older form)",
          "vllm_current": "vLLM estimator, logit(max q)", "vllm_margin": "vLLM estimator, top-2 margin",
          "head_online": "head calibrated online", "head_online_margin": "head + margin calibrated online",
          "adaedl": "AdaEDL adapted bound",
          "sv_companion": "SV companion bins", "dspark_confidence": "DSpark drafter's confidence head",
          "dspark_confidence_ts": "DSpark confidence, temperature-scaled",
          "beta_oracle": "oracle β", "label_ceiling": "label ceiling"}


def save(figure: plt.Figure, path: Path) -> None:
    """Write a figure atomically and close it."""
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)


def roc_legend(name: str, metrics: dict[str, Any], hard_labels: bool) -> str:
    """A signal's legend entry: the AUC of the curve drawn (against the Bernoulli draws), and for soft labels the
    soft-label AUC the report's tables quote, each named."""
    if hard_labels:
        return f"{LABELS[name]} (AUC {metrics['auc']:.3f})"
    return f"{LABELS[name]} (AUC {metrics['auc_bernoulli']:.3f} on draws, {metrics['auc']:.3f} soft)"


def roc_plot(table: TokenTable, offline: dict[str, Any], path: Path, seed: int = 0) -> None:
    """ROC curves against seeded Bernoulli(label) draws (the labels themselves where they are hard), one per signal;
    the legend names which AUC each figure is."""
    draws = np.random.default_rng(seed).random(len(table.label)) < table.label
    hard = bool(np.isin(table.label, (0.0, 1.0)).all())
    figure, axis = plt.subplots(figsize=(5.5, 5))
    scores = table.scores(seed)
    for name in SIGNAL_ORDER:
        if name == "constant" or name not in scores or draws.all() or not draws.any():
            continue
        fpr, tpr, _ = roc_curve(draws, scores[name])
        style = {"linewidth": 2.5} if name == "head" else {"linestyle": "--" if name in ("beta_oracle", "label_ceiling") else "-"}
        axis.plot(fpr, tpr, label=roc_legend(name, offline[name], hard), **style)
    axis.plot([0, 1], [0, 1], color="grey", linewidth=0.8)
    title = ("ROC on held-out tokens" if hard else
             f"ROC on held-out tokens against Bernoulli(accept) draws (seed {seed});\n"
             "soft: the AUC weighting each token by a and 1 − a")
    axis.set(xlabel="false positive rate", ylabel="true positive rate", title=title)
    axis.legend(fontsize=8, loc="lower right")
    save(figure, path)


def predictor_roc_plot(curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], aucs: dict[str, float], path: Path,
                       title: str) -> None:
    """ROC curves of named predictors, each given (labels, scores, weights): a soft label a counts as a positive of
    weight w·a and a negative of weight w·(1 − a), so the curve's area is the soft AUC the legend quotes."""
    figure, axis = plt.subplots(figsize=(5.5, 5))
    for name, (label, score, weight) in curves.items():
        truth = np.concatenate([np.ones(len(label)), np.zeros(len(label))])
        weights = np.concatenate([weight * label, weight * (1 - label)])
        if weights[truth == 1].sum() <= 0 or weights[truth == 0].sum() <= 0:
            continue
        fpr, tpr, _ = roc_curve(truth, np.concatenate([score, score]), sample_weight=weights)
        axis.plot(fpr, tpr, label=f"{name} (AUC {aucs[name]:.3f})", linewidth=2.5 if name == "head" else 1.2)
    axis.plot([0, 1], [0, 1], color="grey", linewidth=0.8)
    axis.set(xlabel="false positive rate", ylabel="true positive rate", title=title)
    axis.legend(fontsize=8, loc="lower right")
    save(figure, path)


def reliability_plot(calibration: dict[str, list[float]], path: Path) -> None:
    """Mean label against mean prediction per bin, with the token counts."""
    figure, axis = plt.subplots(figsize=(5, 5))
    predicted = np.array(calibration["mean_prediction"], dtype=float)
    observed = np.array(calibration["mean_label"], dtype=float)
    filled = np.isfinite(predicted) & np.isfinite(observed)
    axis.plot([0, 1], [0, 1], color="grey", linewidth=0.8, label="perfect calibration")
    axis.plot(predicted[filled], observed[filled], marker="o", label="learned head")
    for x, y, n in zip(predicted[filled], observed[filled], np.array(calibration["count"])[filled]):
        axis.annotate(str(int(n)), (x, y), fontsize=7, textcoords="offset points", xytext=(3, -9))
    axis.set(xlabel="mean predicted acceptance", ylabel="mean label", xlim=(0, 1), ylim=(0, 1),
             title="Reliability diagram (held-out tokens)")
    axis.legend(fontsize=8)
    save(figure, path)


def cumulative_reliability_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One reliability panel per round position k: mean Π_{j≤k} accept against mean Π_{j≤k} â per bin, raw and
    calibrated."""
    positions = sorted({row["k"] for row in rows})
    figure, axes = plt.subplots(1, len(positions), figsize=(2.6 * len(positions), 2.9), squeeze=False, sharey=True)
    for axis, k in zip(axes[0], positions):
        axis.plot([0, 1], [0, 1], color="grey", linewidth=0.8)
        for row in (r for r in rows if r["k"] == k):
            predicted = np.array(row["bins"]["mean_prediction"], dtype=float)
            observed = np.array(row["bins"]["mean_label"], dtype=float)
            filled = np.isfinite(predicted) & np.isfinite(observed)
            axis.plot(predicted[filled], observed[filled], marker="o", markersize=3,
                      label=f"{row['stage']} (ECE {row['ece']:.3f})")
        axis.set(title=f"k = {k}", xlim=(0, 1), ylim=(0, 1), xlabel="mean Π â")
        axis.legend(fontsize=6, loc="upper left")
    axes[0][0].set_ylabel("mean Π min(1, p/q)")
    figure.suptitle("Cumulative acceptance per round position (held-out tokens)", fontsize=9)
    save(figure, path)


def pareto_frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both costs (fewer draft forwards and fewer target calls per token), by
    the first: a curve whose target calls fall as the draft forwards grow."""
    frontier: list[tuple[float, float]] = []
    for drafts, calls in sorted(points, key=lambda point: (point[0], point[1])):
        if not frontier or calls < frontier[-1][1]:
            frontier.append((drafts, calls))
    return frontier


def pareto_plot(rows: list[dict[str, Any]], path: Path, cost_ratio: float) -> None:
    """Target calls per token against draft forwards per token, as counted, per policy (SpecDec++ Figure 3 plots the
    discard rate, which counts SPRINTER's forwards short): every setting as a point, each policy's Pareto frontier
    as a line, and dotted lines of equal modelled speedup at t_draft/t_target = `cost_ratio`."""
    figure, axis = plt.subplots(figsize=(6, 4.5))
    for policy in dict.fromkeys(row["policy"] for row in rows):
        points = [(row["draft_forwards_per_token"], row["verification_rate"]) for row in rows if row["policy"] == policy]
        marker = "*" if policy == "oracle" else "o"
        line = axis.plot(*zip(*pareto_frontier(points)), marker=marker, label=policy,
                         linewidth=2.5 if policy in ("head", "sprinter") else 1.2)[0]
        axis.scatter(*zip(*points), marker=marker, color=line.get_color(), alpha=0.35, s=18)
    left, right = axis.get_xlim()
    bottom, top = axis.get_ylim()
    xs = np.linspace(max(left, 0.0), right, 50)
    for speedup in np.unique(np.round([row["modelled_speedup"] for row in rows], 1)):
        # tokens / (c · drafts + calls) = s  ⇔  calls per token = 1/s − c · drafts per token
        axis.plot(xs, 1.0 / speedup - cost_ratio * xs, color="grey", linestyle=":", linewidth=0.7)
    axis.set(xlim=(left, right), ylim=(bottom, top), xlabel="draft forwards per generated token (a head's included)",
             ylabel="target calls per generated token",
             title=f"Pareto frontier (test prompts; dotted: equal speedup at c = {cost_ratio:g})")
    axis.legend(fontsize=8)
    save(figure, path)


def acceptance_length_plot(lengths: dict[str, list[int]], path: Path) -> None:
    """Histogram of accepted candidates per round for the chosen runs."""
    figure, axis = plt.subplots(figsize=(6, 4))
    top = max((max(v) for v in lengths.values() if v), default=1)
    bins = np.arange(0, top + 2) - 0.5
    for name, values in lengths.items():
        if values:
            axis.hist(values, bins=bins, alpha=0.5, density=True, label=name)
    axis.set(xlabel="accepted draft tokens per target call", ylabel="share of rounds",
             title="Accepted length per round (test prompts)")
    axis.legend(fontsize=8)
    save(figure, path)


def serving_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Modelled throughput against the serving batch size, one panel per cost view, one curve per policy."""
    views = list(dict.fromkeys(row.get("costs", "") for row in rows))
    figure, axes = plt.subplots(1, len(views), figsize=(6 * len(views), 4.5), squeeze=False)
    for axis, view in zip(axes[0], views):
        chosen = [row for row in rows if row.get("costs", "") == view]
        for policy in dict.fromkeys(row["policy"] for row in chosen):
            points = sorted((row["batch_size"], row["tokens_per_s"]) for row in chosen if row["policy"] == policy)
            sizes, throughput = zip(*points)
            axis.plot(sizes, throughput, marker="o", label=policy, linestyle=":" if policy == "oracle" else "-")
        axis.set(xscale="log", yscale="log", xlabel="concurrent requests B", ylabel="modelled tokens/s",
                 title=f"Serving throughput, costs {view}")
        axis.legend(fontsize=8)
    save(figure, path)
