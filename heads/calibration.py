"""Calibration of the cumulative acceptance Π_{j≤k} â_j per position k of a drafting round.

A stop rule 1 − Π â > h is only as good as Π â is calibrated, and a head's error compounds along the
round. `PositionCalibration` maps the k-th candidate's acceptance logit z (the head's logit plus its
class-weight correction) to â_k = σ(scale_k · z + bias_k), one affine map per position with scale_k > 0,
so each map is monotone and keeps the head's ranking within a position. It is temperature scaling
(scale_k = 1 / T_k, DSpark's "sequential temperature scaling") plus a shift: the weighted BCE and the
prior correction leave a bias that a temperature alone cannot remove. Positions beyond the last fitted
one use the last map. `heads.calibration_fit` fits the maps, in order of k, on prompts held out from training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specheads.plumbing.errors import UsageError

METHOD = "sequential_affine_logit"


@dataclass(frozen=True)
class PositionCalibration:
    """â_k = σ(scale[k−1] · z + bias[k−1]) for the k-th candidate of a round (k ≥ 1; k beyond the list: the last)."""

    scale: tuple[float, ...]
    bias: tuple[float, ...]
    method: str = METHOD

    def __post_init__(self) -> None:
        if not self.scale or len(self.scale) != len(self.bias):
            raise UsageError(f"a position calibration needs one scale and one bias per position, got {len(self.scale)} "
                             f"scales and {len(self.bias)} biases")
        if not all(math.isfinite(s) and s > 0 for s in self.scale) or not all(math.isfinite(b) for b in self.bias):
            raise UsageError(f"a position calibration needs finite scales > 0 (a monotone map) and finite biases, got "
                             f"scale {list(self.scale)}, bias {list(self.bias)}")
        if self.method != METHOD:
            raise UsageError(f"unknown calibration method {self.method!r}; known: {METHOD}")

    @property
    def positions(self) -> int:
        """How many positions have their own map."""
        return len(self.scale)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PositionCalibration:
        """From `as_dict`'s form (config.json, checkpoint hyperparameters)."""
        try:
            return cls(tuple(float(s) for s in values["scale"]), tuple(float(b) for b in values["bias"]),
                       values.get("method", METHOD))
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"a calibration must be {{scale: [...], bias: [...], method: {METHOD}}}, got {values!r}") from None

    def as_dict(self) -> dict[str, Any]:
        """Plain lists for JSON."""
        return {"method": self.method, "scale": list(self.scale), "bias": list(self.bias)}

    def logits(self, logits: Tensor | np.ndarray, positions: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """The calibrated logits of candidates at 1-based `positions` (same shape as `logits`)."""
        if isinstance(logits, Tensor):
            index = torch.as_tensor(positions, device=logits.device).long().clamp(1, self.positions) - 1
            scale = torch.tensor(self.scale, dtype=logits.dtype, device=logits.device)
            bias = torch.tensor(self.bias, dtype=logits.dtype, device=logits.device)
            return scale[index] * logits + bias[index]
        index = np.clip(np.asarray(positions, dtype=np.int64), 1, self.positions) - 1
        return np.asarray(self.scale)[index] * logits + np.asarray(self.bias)[index]


def window_starts(row: np.ndarray, position: np.ndarray, length: int) -> np.ndarray:
    """Indices i whose tokens i .. i+length−1 are consecutive positions of one row: a round of `length` candidates
    drafted one after another. Tokens must be sorted by (row, position)."""
    count = len(row)
    if count < length:
        return np.zeros(0, dtype=np.int64)
    breaks = np.ones(count, dtype=bool)
    breaks[1:] = (row[1:] != row[:-1]) | (position[1:] != position[:-1] + 1)
    starts = np.flatnonzero(breaks)
    ends = np.append(starts[1:], count)
    run = np.cumsum(breaks) - 1
    return np.flatnonzero(ends[run] - np.arange(count) >= length)


def round_windows(row: np.ndarray, position: np.ndarray, max_positions: int,
                  depth: np.ndarray | None = None) -> list[np.ndarray]:
    """For k = 1..max_positions, the token indices [windows, k] of every run of k consecutive drafted candidates (any
    drafted token may open a round: a draft model's state there is the same whichever token ended the last round).
    With `depth` (a feature drafter's data, whose q depends on the depth in its round: `data_gen.drafter_labels`), only
    the runs whose tokens sit at depths 1..k, a round as that drafter drafts it."""
    windows = []
    for k in range(1, max_positions + 1):
        index = window_starts(row, position, k)[:, None] + np.arange(k)[None, :]
        if depth is not None:
            index = index[(depth[index] == np.arange(1, k + 1)[None, :]).all(axis=1)]
        windows.append(index)
    return windows


def sigmoid(values: np.ndarray) -> np.ndarray:
    """The logistic function, overflow-free."""
    return np.exp(-np.logaddexp(0.0, -values))


def cumulative_products(logits: np.ndarray, accept: np.ndarray, windows: list[np.ndarray],
                        calibration: PositionCalibration | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per k: (Π_{j≤k} â_j, Π_{j≤k} accept_j) over the windows of k candidates; â from the (calibrated, when a map is
    given) logits. Π accept is the chance that all k are accepted given the drafted tokens (independent uniforms)."""
    result = []
    for k, index in enumerate(windows, start=1):
        z = logits[index]
        if calibration is not None:
            z = calibration.logits(z, np.broadcast_to(np.arange(1, k + 1), z.shape))
        result.append((sigmoid(z).prod(axis=1), accept[index].prod(axis=1)))
    return result
