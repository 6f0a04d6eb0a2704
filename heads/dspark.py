"""The head engines run inside a DSpark drafter: one linear layer over [hidden ; Markov embedding], its sigmoid the
acceptance probability of each drafted position.

vLLM (`qwen3_dspark.DSparkConfidenceHead`), SGLang (`DSparkConfidenceHead`), llama.cpp (`dspark_conf_proj`) and
DeepSpec (`AcceptRatePredictor`) read `confidence_head.proj.{weight,bias}` of a speculators DSpark checkpoint: a
[1, hidden + markov_rank] weight and a [1] bias over the drafter's state after its final norm concatenated with
`markov_head.markov_w1[previous token]` (the hidden state alone when `confidence_head_with_markov` is false), in
float32, and apply σ (SGLang σ(logit / T_k) with its per-position temperature table). A `dspark_confidence` head has
that form and nothing more, so `specheads export --into-dspark` can write it back (`export.dspark`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from specheads.heads.base import AcceptanceHead, check_count
from specheads.plumbing.errors import UsageError


class DSparkConfidenceHead(AcceptanceHead):
    """One linear layer over [the drafter's last state after its final norm ; markov_w1[previous token]] -> one logit.

    It reads the state that produced q_k and the Markov embedding of the token before ŷ_k, never ŷ_k itself, and
    predicts α_k = Σ_v min(p_v, q_v) as DSpark trains its own head (`decides: before_draw`). `markov_rank` 0 reads
    the state alone (any drafter's data); a head of rank R takes the embedding as `markov_embedding` [..., R]. The
    state's standardisation and the class-weight correction are affine, so the whole head is one affine map of
    [hidden ; embedding] (`engine_linear`). Parameter count: hidden_size + markov_rank + 1.
    """

    head_type = "dspark_confidence"
    reads = "context_state"
    purpose = "expect"

    def __init__(self, hidden_size: int, markov_rank: int = 0, extra_features: list[str] | None = None,
                 state_dropout: float = 0.0, state_layer: int | None = None,
                 calibration: dict[str, Any] | None = None) -> None:
        if extra_features:
            raise UsageError(f"a dspark_confidence head reads only what engines feed it (the drafter's state and its "
                             f"Markov embedding), not the signals {list(extra_features)}; set extra_features to []")
        if state_layer is not None:
            raise UsageError(f"a dspark_confidence head reads the drafter's last state after its final norm, as engines "
                             f"do, not the state after layer {state_layer}; use data with the default state layer")
        super().__init__(hidden_size, None, 0, state_dropout=state_dropout, calibration=calibration)
        self.markov_rank = check_count("markov_rank", markov_rank, minimum=0)
        self._record_config(markov_rank=self.markov_rank)
        self.out = nn.Linear(self.input_size, 1)

    @property
    def input_size(self) -> int:
        """hidden_size + markov_rank."""
        return super().input_size + self.markov_rank

    def score(self, features: Tensor) -> Tensor:
        """Logits [...] from features [..., hidden_size + markov_rank]."""
        return self.out(features).squeeze(-1)

    def forward(self, hidden: Tensor, signals: Tensor | None = None, candidate_embedding: Tensor | None = None,
                target_state: Tensor | None = None, staleness: Tensor | None = None,
                markov_embedding: Tensor | None = None) -> Tensor:
        """Acceptance logits [...] from the drafter's state [..., hidden_size] and, for a head of markov_rank R, the
        Markov embedding of the previous token [..., R]."""
        return self.score(self.features(hidden, signals, candidate_embedding, target_state, staleness,
                                        markov_embedding))

    def features(self, hidden: Tensor, signals: Tensor | None = None, candidate_embedding: Tensor | None = None,
                 target_state: Tensor | None = None, staleness: Tensor | None = None,
                 markov_embedding: Tensor | None = None) -> Tensor:
        """[standardised state ; Markov embedding] in the head's dtype."""
        state = super().features(hidden, signals, candidate_embedding, target_state, staleness)
        if not self.markov_rank:
            if markov_embedding is not None:
                raise UsageError("this dspark_confidence head reads no Markov embedding (markov_rank 0); pass "
                                 "markov_embedding=None")
            return state
        if markov_embedding is None:
            raise UsageError(f"this dspark_confidence head reads the Markov embedding of the previous token "
                             f"(markov_rank {self.markov_rank}); pass markov_embedding = markov_head.markov_w1[token]")
        embedding = self._checked("markov_embedding", markov_embedding, hidden, self.markov_rank, "the head's markov_rank")
        return torch.cat([state, embedding.to(state.dtype)], dim=-1)

    @torch.no_grad()
    def engine_linear(self) -> tuple[Tensor, Tensor]:
        """(weight [hidden_size + markov_rank], bias []) in float64 with weight · [hidden ; embedding] + bias equal
        to the head's logit plus its class-weight correction (`probabilities` before any calibration): the state's
        standardisation and the correction folded in."""
        weight = self.out.weight[0].double()
        hidden_weight = weight[: self.hidden_size] / self.hidden_std.double()
        bias = (self.out.bias[0].double() + self.logit_correction.double()
                - (hidden_weight * self.hidden_mean.double()).sum())
        return torch.cat([hidden_weight, weight[self.hidden_size:]]), bias
