"""The weighted binary cross-entropy on soft labels (SpecDec++ §4.4, docs/method.md "Heads and loss")."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, w_acc: float = 1.0, w_rej: float = 6.0) -> torch.Tensor:
    """−[w_acc·a·log â + w_rej·(1−a)·log(1−â)] summed, over Σ(w_acc·a + w_rej·(1−a)); â = sigmoid(logits).

    Computed from logits (log σ(z) = −softplus(−z)), so it stays finite for confident predictions.
    """
    logits, labels = logits.float(), labels.float()
    accepted = w_acc * labels
    rejected = w_rej * (1.0 - labels)
    total = accepted * F.softplus(-logits) + rejected * F.softplus(logits)
    return total.sum() / (accepted + rejected).sum().clamp_min(1e-12)
