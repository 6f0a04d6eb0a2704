"""Fitting `PositionCalibration` (heads.calibration) on held-out tokens, one position after another.

For k = 1..K the map of position k is fitted with the maps of positions < k fixed, by minimising the
binary cross-entropy of the cumulative product Π_{j≤k} â_j against the cumulative soft label
Π_{j≤k} min(1, p_j/q_j) over every run of k consecutive drafted candidates (DSpark's sequential
scheme): the product, not each factor, is what the stop rule thresholds.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize

from specheads.heads.calibration import PositionCalibration, round_windows, sigmoid
from specheads.plumbing.errors import UsageError

EPSILON = 1e-7
LOG_SCALE_BOUNDS = (-4.0, 3.0)
BIAS_BOUNDS = (-15.0, 15.0)


def product_cross_entropy(parameters: np.ndarray, prefix: np.ndarray, last_logit: np.ndarray,
                          label: np.ndarray) -> float:
    """Mean BCE of prefix · σ(exp(log_scale) · z + bias) against the soft `label`; parameters = (log_scale, bias)."""
    product = np.clip(prefix * sigmoid(np.exp(parameters[0]) * last_logit + parameters[1]), EPSILON, 1 - EPSILON)
    return float(-np.mean(label * np.log(product) + (1 - label) * np.log1p(-product)))


def fit_position_calibration(logits: np.ndarray, accept: np.ndarray, row: np.ndarray, position: np.ndarray,
                             max_positions: int) -> PositionCalibration:
    """The per-position maps fitted on drafted tokens sorted by (row, position): `logits` are the head's corrected
    logits, `accept` the soft labels min(1, p/q). A position with no run of that length keeps the previous map."""
    if max_positions < 1:
        raise UsageError(f"calibrate_positions must be at least 1 to fit a calibration, got {max_positions}")
    windows = round_windows(row, position, max_positions)
    if not len(windows[0]):
        raise UsageError("no drafted token to fit the calibration on; give the calibration split more prompts")
    scales: list[float] = []
    biases: list[float] = []
    for k, index in enumerate(windows, start=1):
        if not len(index):
            scales.append(scales[-1])
            biases.append(biases[-1])
            continue
        z = logits[index]
        prefix = np.ones(len(index))
        for j in range(k - 1):
            prefix *= sigmoid(scales[j] * z[:, j] + biases[j])
        label = accept[index].prod(axis=1)
        start = np.array([0.0, 0.0]) if k == 1 else np.array([np.log(scales[-1]), biases[-1]])
        fit = minimize(product_cross_entropy, start, args=(prefix, z[:, -1], label), method="L-BFGS-B",
                       bounds=[LOG_SCALE_BOUNDS, BIAS_BOUNDS])
        scales.append(float(np.exp(fit.x[0])))
        biases.append(float(fit.x[1]))
    return PositionCalibration(tuple(scales), tuple(biases))
