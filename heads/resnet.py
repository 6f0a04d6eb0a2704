"""SpecDec++'s acceptance head: residual SiLU blocks over a draft state, and its on-time variant.

`ResNetAcceptanceHead` reads the state that has read the candidate (SpecDec++), so a decoder has its
score of ŷ_k only after the next draft forward. `OnTimeAcceptanceHead` reads the state that produced q
for ŷ_k together with ŷ_k's input embedding (DSpark's inputs), so its score exists the moment ŷ_k is drafted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from specheads.heads.base import AcceptanceHead, check_count


class ResNetAcceptanceHead(AcceptanceHead):
    """D residual blocks x <- x + SiLU(W_d x + b_d), each with its own weights, then a linear layer to one logit.

    The input (width d = hidden_size + candidate_embedding_size + len(extra_features)) is the draft hidden
    state at the candidate, i.e. after the draft has read it, concatenated with the standardised signals.
    depth = 0 is a linear probe. Parameter count: D*(d^2 + d) + d + 1.

    The blocks start at zero, so a fresh head of any depth computes exactly the linear probe of its
    output layer; every block still gets gradients from the first step because SiLU'(0) = 1/2.
    """

    head_type = "specdecpp_resnet"
    reads = "candidate_state"
    purpose = "stop"

    def __init__(self, hidden_size: int, depth: int = 3, extra_features: list[str] | None = None,
                 state_dropout: float = 0.0, state_layer: int | None = None, candidate_embedding_size: int = 0,
                 calibration: dict[str, Any] | None = None) -> None:
        super().__init__(hidden_size, extra_features, candidate_embedding_size, state_dropout=state_dropout,
                         state_layer=state_layer, calibration=calibration)
        self.depth = check_count("depth", depth, minimum=0)
        self._record_config(depth=self.depth, candidate_embedding_size=self.candidate_embedding_size)
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


class OnTimeAcceptanceHead(ResNetAcceptanceHead):
    """The SpecDec++ head on time: the same blocks over the state *before* candidate ŷ_k (the one that produced
    q_k), ŷ_k's input embedding (candidate_embedding_size > 0) and the draft's signals of ŷ_k. A decoder scores
    ŷ_k right after drafting it and can stop there, with no extra draft forward."""

    head_type = "specdecpp_ontime"
    reads = "context_state"
