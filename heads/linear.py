"""SPRINTER's verifier: one linear layer over the draft state before the candidate."""

from __future__ import annotations

from torch import Tensor, nn

from specheads.heads.base import AcceptanceHead


class LinearVerifier(AcceptanceHead):
    """One linear layer over concat[hidden, candidate embedding, standardised signals] -> one logit.

    The hidden state is the draft's state before the candidate (the one that produced q for it); the
    candidate's input embedding is read only when candidate_embedding_size > 0.
    Parameter count: d + 1 with d = hidden_size + candidate_embedding_size + len(extra_features).
    """

    head_type = "sprinter_linear"
    reads = "context_state"
    purpose = "verify"

    def __init__(self, hidden_size: int, extra_features: list[str] | None = None,
                 candidate_embedding_size: int = 0, state_dropout: float = 0.0, state_layer: int | None = None) -> None:
        super().__init__(hidden_size, extra_features, candidate_embedding_size, state_dropout, state_layer)
        self._record_config(candidate_embedding_size=self.candidate_embedding_size)
        self.out = nn.Linear(self.input_size, 1)

    def score(self, features: Tensor) -> Tensor:
        """Logits [...] from features [..., d]."""
        return self.out(features).squeeze(-1)
