"""Fitting `PositionCalibration` (heads.calibration) on held-out tokens, one position after another.

For k = 1..K the map of position k is fitted with the maps of positions < k fixed, by minimising the
binary cross-entropy of the cumulative product Π_{j≤k} â_j against the cumulative soft label
Π_{j≤k} min(1, p_j/q_j) over every run of k consecutive drafted candidates (DSpark's sequential
scheme): the product, not each factor, is what the stop rule thresholds. A head of a tree's second children
is calibrated per depth instead (`fit_sibling_calibration`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.optimize import minimize

from specheads.heads.calibration import PositionCalibration, round_windows, sigmoid
from specheads.plumbing.errors import UsageError

EPSILON = 1e-7
LOG_SCALE_BOUNDS = (-4.0, 3.0)
BIAS_BOUNDS = (-15.0, 15.0)


def product_cross_entropy(parameters: np.ndarray, prefix: np.ndarray, last_logit: np.ndarray,
                          label: np.ndarray, weight: np.ndarray | None = None) -> float:
    """Mean BCE (weighted by `weight`, when given) of prefix · σ(exp(log_scale) · z + bias) against the soft `label`;
    parameters = (log_scale, bias)."""
    product = np.clip(prefix * sigmoid(np.exp(parameters[0]) * last_logit + parameters[1]), EPSILON, 1 - EPSILON)
    return float(-np.average(label * np.log(product) + (1 - label) * np.log1p(-product), weights=weight))


Map = tuple[float, float]  # (scale, bias) of one position


def fitted_maps(row: np.ndarray, position: np.ndarray, max_positions: int,
                fit: Callable[[int, np.ndarray, list[Map]], Map | None],
                depth: np.ndarray | None = None) -> PositionCalibration:
    """One map per position k = 1..max_positions, in order: `fit(k, windows of k tokens, the maps of positions < k)`
    gives (scale, bias), or None where there is nothing to fit; a position with no run of length k, or nothing to
    fit, keeps the previous map. With `depth` (a feature drafter's data) a window is a round at depths 1..k."""
    if max_positions < 1:
        raise UsageError(f"calibrate_positions must be at least 1 to fit a calibration, got {max_positions}")
    windows = round_windows(row, position, max_positions, depth)
    if not len(windows[0]):
        raise UsageError("no drafted token to fit the calibration on; give the calibration split more prompts")
    maps: list[Map] = []
    for k, index in enumerate(windows, start=1):
        fitted = fit(k, index, maps) if len(index) else None
        maps.append(fitted or (maps[-1] if maps else (1.0, 0.0)))
    return PositionCalibration(tuple(m[0] for m in maps), tuple(m[1] for m in maps))


def minimised(loss: Callable[..., float], maps: list[Map], *args: np.ndarray) -> Map:
    """The (scale, bias) minimising `loss((log_scale, bias), *args)`, started from the last of `maps` (identity when
    there is none)."""
    start = np.array([np.log(maps[-1][0]), maps[-1][1]]) if maps else np.array([0.0, 0.0])
    result = minimize(loss, start, args=args, method="L-BFGS-B", bounds=[LOG_SCALE_BOUNDS, BIAS_BOUNDS])
    return float(np.exp(result.x[0])), float(result.x[1])


def window_prefix(z: np.ndarray, maps: list[Map]) -> np.ndarray:
    """Π over the first len(`maps`) candidates of each window (logits `z` [windows, k]) of σ(scale_j · z_j + bias_j)."""
    prefix = np.ones(len(z))
    for j, (scale, bias) in enumerate(maps):
        prefix *= sigmoid(scale * z[:, j] + bias)
    return prefix


def fit_position_calibration(logits: np.ndarray, accept: np.ndarray, row: np.ndarray, position: np.ndarray,
                             max_positions: int, depth: np.ndarray | None = None) -> PositionCalibration:
    """The per-position maps fitted on drafted tokens sorted by (row, position): `logits` are the head's corrected
    logits, `accept` the soft labels min(1, p/q); `depth`, each token's depth in its round where the data has one. A
    position with no run of that length keeps the previous map."""
    def fit(k: int, index: np.ndarray, maps: list[Map]) -> Map:
        z = logits[index]
        return minimised(product_cross_entropy, maps, window_prefix(z, maps), z[:, -1], accept[index].prod(axis=1))

    return fitted_maps(row, position, max_positions, fit, depth)


def fit_position_temperatures(logits: np.ndarray, accept: np.ndarray, row: np.ndarray, position: np.ndarray,
                              max_positions: int, depth: np.ndarray | None = None) -> PositionCalibration:
    """Sequential temperature scaling, as SGLang applies it to a DSpark drafter's confidence head and DeepSpec
    evaluates it: per position k, σ(z / T_k), T_k fitted with the temperatures of positions < k fixed by the BCE of the
    cumulative product against Π min(1, p/q) over the rounds of k candidates; a temperature alone, no shift (the map's
    scale 1/T_k, its bias 0). The arguments are `fit_position_calibration`'s."""
    def fit(k: int, index: np.ndarray, maps: list[Map]) -> Map:
        z = logits[index]
        prefix, label = window_prefix(z, maps), accept[index].prod(axis=1)
        start = np.log(maps[-1][0]) if maps else 0.0
        result = minimize(lambda x: product_cross_entropy(np.array([x[0], 0.0]), prefix, z[:, -1], label), [start],
                          method="L-BFGS-B", bounds=[LOG_SCALE_BOUNDS])
        return float(np.exp(result.x[0])), 0.0

    return fitted_maps(row, position, max_positions, fit, depth)


def fit_sibling_calibration(logits: np.ndarray, accept: np.ndarray, first_accept: np.ndarray, row: np.ndarray,
                            position: np.ndarray, max_positions: int, depth: np.ndarray | None = None
                            ) -> PositionCalibration:
    """Per-depth maps for a head of a tree's second children (`data.children: second`), fitted on drafted positions
    sorted by (row, position): `logits` are its corrected logits of the second children, `accept` their labels
    min(1, p₂/q₂) and `first_accept` the first children's min(1, p/q) there.

    A tree checks the second child at depth k of a path only when the first children at depths 1..k−1 were accepted
    and the one at depth k was rejected; so the map of depth k is fitted on every run of k drafted positions with
    weight Π_{j<k} first_accept_j · (1 − first_accept_k), the chance the tree gets there. A depth with no run (or no
    weight) keeps the previous map. `depth`, a feature drafter's data's depth of each position in its round, makes
    the runs rounds (`fitted_maps`), as the chain head's fit reads them."""
    def fit(k: int, index: np.ndarray, maps: list[Map]) -> Map | None:
        last = index[:, -1]
        weight = first_accept[index[:, :-1]].prod(axis=1) * (1 - first_accept[last])
        if weight.sum() <= 0:
            return None
        return minimised(product_cross_entropy, maps, np.ones(len(last)), logits[last], accept[last], weight)

    return fitted_maps(row, position, max_positions, fit, depth)
