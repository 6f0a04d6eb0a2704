"""Where a head starts: the weighted logistic regression of the draft's own signals on the labels.

With zero-initialised blocks and this output layer, the untrained head is exactly the best linear use of
log q(ŷ), H(q) and max q under the training loss. The hidden state then only has to add to it, instead of
Adam growing hundreds of noisy state weights as fast as the few informative signal weights.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression


def signal_probe(signals: torch.Tensor, labels: torch.Tensor, w_acc: float, w_rej: float,
                 max_tokens: int = 200_000, seed: int = 0) -> tuple[torch.Tensor, float] | None:
    """(coefficients [k], intercept) minimising the weighted BCE w_acc·a·log σ(z) + w_rej·(1 − a)·log(1 − σ(z)) of
    z = coefficients·signals + intercept on soft labels a; None when the labels hold only one class.

    `signals` [n, k] are already standardised; at most `max_tokens` tokens (a seeded sample) are used.
    """
    label = labels.double().numpy()
    x = signals.double().numpy()
    if len(label) > max_tokens:
        chosen = np.random.default_rng(seed).choice(len(label), max_tokens, replace=False)
        x, label = x[chosen], label[chosen]
    positive, negative = w_acc * label, w_rej * (1.0 - label)
    if positive.sum() <= 0 or negative.sum() <= 0:
        return None
    if x.shape[1] == 0:
        return torch.zeros(0), math.log(positive.sum() / negative.sum())
    # a soft label is an accepted and a rejected copy of the token, weighted by the loss's two terms
    model = LogisticRegression(C=1.0, max_iter=500)
    model.fit(np.concatenate([x, x]), np.concatenate([np.ones(len(x)), np.zeros(len(x))]),
              sample_weight=np.concatenate([positive, negative]))
    return torch.from_numpy(model.coef_[0]).float(), float(model.intercept_[0])
