"""SpecDec++'s acceptance head: residual SiLU blocks over a draft state, and its on-time variant.

`ResNetAcceptanceHead` reads the state that has read the candidate (SpecDec++), so a decoder has its
score of ŷ_k only after the next draft forward. `OnTimeAcceptanceHead` reads the state that produced q
for ŷ_k together with ŷ_k's input embedding (DSpark's inputs), so its score exists the moment ŷ_k is drafted.
`ExpectedAcceptanceHead` reads only what exists before ŷ_k is drawn and predicts α_k = Σ_v min(p_v, q_v), the
chance that whatever the draft draws there is accepted: a score a batch scheduler may rank positions by and stay
exact (docs/decoding-core.md "Verify budgets").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from specheads.heads.base import AcceptanceHead, check_count
from specheads.plumbing.errors import UsageError


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
                 calibration: dict[str, Any] | None = None, target_state_size: int = 0) -> None:
        super().__init__(hidden_size, extra_features, candidate_embedding_size, state_dropout=state_dropout,
                         state_layer=state_layer, calibration=calibration, target_state_size=target_state_size)
        self.depth = check_count("depth", depth, minimum=0)
        self._record_config(depth=self.depth, candidate_embedding_size=self.candidate_embedding_size,
                            target_state_size=self.target_state_size)
        if not self.target_state_size:  # configs of heads that read no target state stay as they were
            self._hub_mixin_config.pop("target_state_size", None)
        width = self.input_size
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(self.depth))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.out = nn.Linear(width, 1)

    def score(self, features: Tensor) -> Tensor:
        """Logits [...] from features [..., d]."""
        return self.out(self.trunk(features)).squeeze(-1)

    def trunk(self, features: Tensor) -> Tensor:
        """The representation [..., d] the output layer reads (an auxiliary target may read it too)."""
        x = features
        for block in self.blocks:
            x = x + torch.nn.functional.silu(block(x))
        return x


class OnTimeAcceptanceHead(ResNetAcceptanceHead):
    """The SpecDec++ head on time: the same blocks over the state *before* candidate ŷ_k (the one that produced
    q_k), ŷ_k's input embedding (candidate_embedding_size > 0) and the draft's signals of ŷ_k. A decoder scores
    ŷ_k right after drafting it and can stop there, with no extra draft forward."""

    head_type = "specdecpp_ontime"
    reads = "context_state"


PRE_DRAW_SIGNALS = ("entropy", "top1")
"""The draft signals that exist before ŷ_k is drawn: they describe q_k, not the token drawn from it."""


class ExpectedAcceptanceHead(ResNetAcceptanceHead):
    """The expected-acceptance head (DSpark's ex-ante head): the same blocks over the draft state that produced q_k
    and signals of q_k alone (`PRE_DRAW_SIGNALS`), trained on the analytic label α_k = Σ_v min(p_v, q_v) =
    E_{ŷ∼q}[min(1, p(ŷ)/q(ŷ))] at every position. Nothing it reads depends on ŷ_k, so the survival product
    Π_{j≤k} α̂_j is known before ŷ_k is drawn (`decides: before_draw`) and a verify length chosen from it is a
    stopping time of the draft: the output stays the target's distribution."""

    head_type = "expected_acceptance"
    reads = "context_state"
    purpose = "expect"

    def __init__(self, hidden_size: int, depth: int = 3, extra_features: list[str] | None = None,
                 state_dropout: float = 0.0, state_layer: int | None = None, candidate_embedding_size: int = 0,
                 calibration: dict[str, Any] | None = None) -> None:
        drawn = [name for name in extra_features or [] if name not in PRE_DRAW_SIGNALS]
        if drawn or candidate_embedding_size:
            what = f"the signals {drawn}" if drawn else "the candidate's embedding"
            raise UsageError(f"an expected_acceptance head decides before the candidate is drawn, so it cannot read "
                             f"{what}; use extra_features from {list(PRE_DRAW_SIGNALS)} and no candidate embedding")
        super().__init__(hidden_size, depth, extra_features, state_dropout, state_layer, 0, calibration)
