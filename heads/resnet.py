"""SpecDec++'s acceptance head: a stack of residual SiLU blocks over the draft's candidate state."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specheads.heads.base import AcceptanceHead, check_count


class ResNetAcceptanceHead(AcceptanceHead):
    """D residual blocks x <- x + SiLU(W_d x + b_d), each with its own weights, then a linear layer to one logit.

    The input (width d = hidden_size + len(extra_features)) is the draft hidden state at the
    candidate, i.e. after the draft has read it, concatenated with the standardised signals.
    depth = 0 is a linear probe. Parameter count: D*(d^2 + d) + d + 1.

    The blocks start at zero, so a fresh head of any depth computes exactly the linear probe of its
    output layer; every block still gets gradients from the first step because SiLU'(0) = 1/2.
    """

    head_type = "specdecpp_resnet"
    reads = "candidate_state"

    def __init__(self, hidden_size: int, depth: int = 3, extra_features: list[str] | None = None,
                 state_dropout: float = 0.0, state_layer: int | None = None) -> None:
        super().__init__(hidden_size, extra_features, state_dropout=state_dropout, state_layer=state_layer)
        self.depth = check_count("depth", depth, minimum=0)
        self._record_config(depth=self.depth)
        width = self.input_size
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(self.depth))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.out = nn.Linear(width, 1)

    def score(self, features: Tensor) -> Tensor:
        """Logits [...] from features [..., d]."""
        x = features
        for block in self.blocks:
            x = x + torch.nn.functional.silu(block(x))
        return self.out(x).squeeze(-1)
