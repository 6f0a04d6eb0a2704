"""The draft's logits and the training-free signals read from them, one definition for labelling and decoding."""

from __future__ import annotations

from typing import Any

import torch

from specheads.sampling import SamplingTransform


def output_logits(model: Any, states: torch.Tensor) -> torch.Tensor:
    """The LM head on `states`, with the final soft-capping some families use; float32, on the device of `states`."""
    logits = model.get_output_embeddings()(states).float().to(states.device)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def signal_log_probs(draft_logits: torch.Tensor, logq_all: torch.Tensor, transform: SamplingTransform) -> torch.Tensor:
    """The draft distribution the training-free signals read: q after the transform, or, since greedy q is
    one-hot, the untempered draft distribution under T = 0 (decoding computes them the same way)."""
    return draft_logits.float().log_softmax(-1) if transform.greedy else logq_all


def signal_statistics(logq_signal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy, top-1 probability) per row of `signal_log_probs`' output."""
    q_signal = logq_signal.exp()
    return torch.special.entr(q_signal).sum(-1), q_signal.amax(-1)
