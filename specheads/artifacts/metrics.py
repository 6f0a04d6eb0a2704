"""Classification metrics for acceptance predictors with soft or binary labels (docs/method.md "Evaluation").

Soft labels a ∈ [0, 1] (SpecDec++'s min(1, p/q)) are handled in expectation: each token counts as a
positive with weight a and as a negative with weight 1 − a. Binary labels are the special case a ∈ {0, 1}.
Optional per-token `weights` (e.g. how often a tree checks the token) multiply both.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import average_precision_score, brier_score_loss, roc_auc_score

EPS = 1e-6


def _expanded(labels: np.ndarray, scores: np.ndarray,
              weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each token twice: as a positive weighted a (× its weight), as a negative weighted 1 − a (× its weight)."""
    labels = np.asarray(labels, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    scale = 1.0 if weights is None else np.asarray(weights, dtype=np.float64)
    truth = np.concatenate([np.ones_like(labels), np.zeros_like(labels)])
    return truth, np.concatenate([scores, scores]), np.concatenate([labels * scale, (1.0 - labels) * scale])


def soft_auc(labels: np.ndarray, scores: np.ndarray, weights: np.ndarray | None = None) -> float:
    """ROC AUC in expectation over soft labels (NaN when one class has no weight)."""
    truth, scores2, weights = _expanded(labels, scores, weights)
    if weights[truth == 1].sum() <= 0 or weights[truth == 0].sum() <= 0:
        return float("nan")
    return float(roc_auc_score(truth, scores2, sample_weight=weights))


def soft_pr_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Average precision (PR-AUC) in expectation over soft labels."""
    truth, scores2, weights = _expanded(labels, scores)
    return float(average_precision_score(truth, scores2, sample_weight=weights))


def bernoulli_auc(labels: np.ndarray, scores: np.ndarray, seed: int = 0) -> float:
    """ROC AUC against one seeded Bernoulli(a) draw per token."""
    draws = np.random.default_rng(seed).random(len(labels)) < np.asarray(labels)
    if draws.all() or not draws.any():
        return float("nan")
    return float(roc_auc_score(draws, scores))


def binary_kl(labels: np.ndarray, predictions: np.ndarray, weights: np.ndarray | None = None) -> float:
    """(Weighted) mean of a·log(a/â) + (1−a)·log((1−a)/(1−â)) with 0·log 0 = 0 (SpecDec++ Table 3)."""
    a = np.asarray(labels, dtype=np.float64)
    p = np.clip(np.asarray(predictions, dtype=np.float64), EPS, 1 - EPS)
    with np.errstate(divide="ignore", invalid="ignore"):
        positive = np.where(a > 0, a * np.log(a / p), 0.0)
        negative = np.where(a < 1, (1 - a) * np.log((1 - a) / (1 - p)), 0.0)
    return float(np.average(positive + negative, weights=weights))


def brier(labels: np.ndarray, predictions: np.ndarray) -> float:
    """Brier score in expectation over soft labels (equals sklearn's on binary labels)."""
    truth, predictions2, weights = _expanded(labels, predictions)
    return float(brier_score_loss(truth, np.clip(predictions2, 0, 1), sample_weight=weights))


def calibration_bins(labels: np.ndarray, predictions: np.ndarray, bins: int = 10,
                     weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Equal-width bins of the prediction: count (summed weight), mean prediction and mean label per bin (empty bins:
    NaN)."""
    predictions = np.clip(np.asarray(predictions, dtype=np.float64), 0, 1)
    index = np.minimum((predictions * bins).astype(int), bins - 1)
    scale = np.ones_like(predictions) if weights is None else np.asarray(weights, dtype=np.float64)
    count = np.bincount(index, scale, minlength=bins).astype(np.float64)
    with np.errstate(invalid="ignore"):
        mean_prediction = np.bincount(index, scale * predictions, minlength=bins) / count
        mean_label = np.bincount(index, scale * np.asarray(labels, dtype=np.float64), minlength=bins) / count
    return {"count": count, "mean_prediction": mean_prediction, "mean_label": mean_label}


def expected_calibration_error(labels: np.ndarray, predictions: np.ndarray, bins: int = 10,
                               weights: np.ndarray | None = None) -> float:
    """Σ_b (n_b / n)·|mean label_b − mean prediction_b| over equal-width bins (n: summed weights, when given)."""
    table = calibration_bins(labels, predictions, bins, weights)
    filled = table["count"] > 0
    gaps = np.abs(table["mean_label"][filled] - table["mean_prediction"][filled])
    total = table["count"].sum()
    return float(np.sum(table["count"][filled] * gaps) / total) if total > 0 else 0.0


def classification_metrics(labels: np.ndarray, predictions: np.ndarray, bins: int = 10) -> dict[str, float]:
    """AUC, PR-AUC, Brier, ECE and binary KL of probability predictions against soft labels."""
    return {
        "auc": soft_auc(labels, predictions),
        "pr_auc": soft_pr_auc(labels, predictions),
        "brier": brier(labels, predictions),
        "ece": expected_calibration_error(labels, predictions, bins),
        "binary_kl": binary_kl(labels, predictions),
    }


def baseline_scores(logq: np.ndarray, entropy: np.ndarray, top1: np.ndarray) -> dict[str, np.ndarray]:
    """The training-free signals as scores (higher = more likely accepted): SVIP, draft top-1, draft q(ŷ)."""
    return {
        "svip_entropy": -np.sqrt(np.clip(np.asarray(entropy, dtype=np.float64), 0, None)),
        "draft_top1": np.asarray(top1, dtype=np.float64),
        "draft_prob": np.exp(np.asarray(logq, dtype=np.float64)),
    }
