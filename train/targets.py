"""Which response positions a head learns from, and its label there (docs/data.md "Which state a head reads").

Per-position tensors are [B, n] (padded; `valid` marks real positions). Position j (0-based) is the
candidate ŷ_{j+1}:
- a `candidate_state` head (SpecDec++) reads features[j + 1] and learns the soft label `accept[j]`,
  only where the candidate was mixed in (`is_draft[j]`): its state has read ŷ_{j+1};
- a `context_state` verifier (SPRINTER) reads features[j] and learns 1[logq − logp ≤ log τ]. With
  `contexts="consistent"` it keeps only positions whose whole prefix is target tokens (the label was
  computed on that prefix); `"all"` keeps every position.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

CANDIDATE_STATE = "candidate_state"
CONTEXT_STATE = "context_state"
Contexts = Literal["consistent", "all"]


def token_targets(batch: dict[str, torch.Tensor], reads: str, tau: float = 1.0,
                  contexts: Contexts = "consistent") -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [B, n] bool, label [B, n] float) for a head that reads `reads`."""
    valid = batch["valid"]
    if reads == CANDIDATE_STATE:
        return valid & batch["is_draft"], batch["accept"].float()
    if reads != CONTEXT_STATE:
        raise ValueError(f"unknown hidden state {reads!r}")
    label = ((batch["logq"] - batch["logp"]) <= math.log(tau)).float()
    if contexts == "all":
        return valid, label
    drafted_before = torch.cumsum(batch["is_draft"].long(), dim=1) - batch["is_draft"].long()
    return valid & (drafted_before == 0), label


def head_states(features: torch.Tensor, reads: str) -> torch.Tensor:
    """The states aligned with positions [B, n, h] from features [B, n + 1, h] (row 0 = prompt's last)."""
    return features[:, 1:] if reads == CANDIDATE_STATE else features[:, :-1]
