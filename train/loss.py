"""The weighted binary cross-entropy on soft labels (SpecDec++ §4.4, docs/method.md "Heads and loss")."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, w_acc: float = 1.0, w_rej: float = 6.0,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """−[w_acc·a·log â + w_rej·(1−a)·log(1−â)] summed, over Σ(w_acc·a + w_rej·(1−a)); â = sigmoid(logits). Per-token
    `weights` (DSpark's position weights, `position_weights`) multiply both terms of each token.

    Computed from logits (log σ(z) = −softplus(−z)), so it stays finite for confident predictions.
    """
    logits, labels = logits.float(), labels.float()
    scale = 1.0 if weights is None else weights.float()
    accepted = w_acc * labels * scale
    rejected = w_rej * (1.0 - labels) * scale
    total = accepted * F.softplus(-logits) + rejected * F.softplus(logits)
    return total.sum() / (accepted + rejected).sum().clamp_min(1e-12)


def run_positions(is_draft: torch.Tensor) -> torch.Tensor:
    """[B, n] position of each drafted token in its run of consecutive drafted tokens (1 after a target token or the
    prompt, 2 next, ...; 0 at target tokens): how far the draft has gone on its own, the token mix's round position."""
    drafted = is_draft.long()
    index = torch.arange(drafted.shape[1], device=drafted.device).expand_as(drafted)
    last_target = torch.where(drafted.bool(), torch.full_like(index, -1), index).cummax(dim=1).values
    return torch.where(drafted.bool(), index - last_target, torch.zeros_like(index))


def position_weights(positions: torch.Tensor, gamma: float) -> torch.Tensor:
    """DSpark's position weights w_k = exp(−(k − 1)/γ): a late candidate matters only if every earlier one survives."""
    return torch.exp(-(positions.float() - 1.0).clamp_min(0.0) / gamma)
