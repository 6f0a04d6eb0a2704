"""SV's companion predictor (Speculative Verification §4.2): a second small model beside the draft scores each drafted
token from how the two agree.

For a drafted token ŷ at a step with draft distribution q and companion distribution c (both under the decoding's
sampling transform) SV observes
- S = Σ_v min(q_v, c_v): how well draft and companion agree at that step;
- A = min(1, c(ŷ)/q(ŷ)): the token's acceptance were the companion the target.
Each is cut into equal-count bins on a profiling run (SV: 10–30 bins of S, 10–20 of A) and a token's prediction is
the mean acceptance of its (S, A) cell there (`BinTable`). eval profiles the bins on training rows
(`specheads.eval.companion`) and scores held-out tokens offline; the round engine runs the companion beside the draft
(one companion forward per draft forward, its own KV cache) for the `sv_companion` stop rule.

A reads the drawn token, so the prediction may end a round's drafting (exact) but not rank drafted positions for a
verify budget (docs/decoding-core.md "Verify budgets").

A companion forward is counted as `Companion.cost` draft forwards (`forward_cost`): the weights it multiplies per token
that the draft has not already multiplied, over the draft's (`weights_read_per_token`: every weight but the lookup
tables). Another model of the draft's size costs 1 (one 10× the draft's size, 10). An acceptance head's forward is
priced the same way (`head_forward_cost`): its weights over the draft's. On a self-speculative pair a companion that
runs the draft's first layers and then layers of its own could branch from the draft's state, as in SV's LayerSkip
setting (its evaluation, "Performance on SD Variants": the draft exits after 4 or 20 layers, the companion takes the
next 4 or 5), so only its own layers and its output head are counted. The round engine runs the companion whole, with
its own cache (the same outputs), so measured times do not show that saving: the count is what a branching deployment
would pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

S_BINS, A_BINS = 20, 15
"""Bins of S and A (inside SV's ranges, 10–30 and 10–20)."""


@dataclass
class BinTable:
    """SV's profile: the bin edges of S and A and the mean acceptance of each (S, A) cell (the profile's mean where a
    cell is empty)."""

    s_edges: np.ndarray
    a_edges: np.ndarray
    means: np.ndarray

    def predict(self, s: np.ndarray, a: np.ndarray) -> np.ndarray:
        """The cell mean of each token."""
        return self.means[cell(self.s_edges, s), cell(self.a_edges, a)]


def equal_count_edges(values: np.ndarray, bins: int) -> np.ndarray:
    """Inner edges that cut `values` into `bins` bins holding about as many values each (ties merge bins)."""
    return np.unique(np.quantile(values, np.linspace(0, 1, bins + 1)[1:-1]))


def cell(edges: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The bin of each value."""
    return np.searchsorted(edges, values, side="right")


def profile(s: np.ndarray, a: np.ndarray, accept: np.ndarray, s_bins: int = S_BINS, a_bins: int = A_BINS) -> BinTable:
    """SV's bins and cell means from a profiling set."""
    s_edges, a_edges = equal_count_edges(s, s_bins), equal_count_edges(a, a_bins)
    rows, columns = cell(s_edges, s), cell(a_edges, a)
    sums = np.zeros((len(s_edges) + 1, len(a_edges) + 1))
    counts = np.zeros_like(sums)
    np.add.at(sums, (rows, columns), accept)
    np.add.at(counts, (rows, columns), 1)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), accept.mean())
    return BinTable(s_edges, a_edges, means)


def agreement(q: torch.Tensor, c: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SV's (S, A) of drafted tokens: `q`, `c` the draft's and the companion's probabilities [..., V], `token` the
    drafted token [...]."""
    s = torch.minimum(q, c).sum(-1)
    index = token.unsqueeze(-1)
    a = (c.gather(-1, index) / q.gather(-1, index).clamp_min(1e-30)).clamp(max=1.0).squeeze(-1)
    return s, a


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two modules hold the very same parameters (models built on one backbone by `without_layers` share
    them; compared as objects, since offloaded weights have no storage address)."""
    ours, theirs = list(a.parameters()), list(b.parameters())
    return len(ours) == len(theirs) and all(x is y for x, y in zip(ours, theirs))


def weights_read_per_token(model: torch.nn.Module) -> int:
    """The parameters one forward multiplies for each token it reads: all of `model`'s but its lookup tables (the input
    embedding, a position embedding), a tied output head counted once, as the output head. An acceptance head's are all
    of its parameters. A feature drafter says its own (`FeatureDraft.forward_weights`: the modules its forward runs,
    not those only its training reads)."""
    own = getattr(model, "forward_weights", None)
    if callable(own):
        return int(own())
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kept = getattr(output, "weight", None)
    lookups = {id(module.weight) for module in model.modules()
               if isinstance(module, torch.nn.Embedding) and module.weight is not kept}
    return sum(p.numel() for p in model.parameters() if id(p) not in lookups)


def forward_cost(companion: torch.nn.Module, draft: torch.nn.Module) -> float:
    """A companion forward in draft forwards: the weights it reads per token (`weights_read_per_token`) less those of the
    decoder layers it shares with the draft as a prefix (the same embeddings and the same layers in the same order, run
    on the same tokens, give the same states), over the draft's weights read per token."""
    ours, theirs = list(companion.get_decoder().layers), list(draft.get_decoder().layers)
    shared = 0
    if same_weights(companion.get_input_embeddings(), draft.get_input_embeddings()):
        while shared < min(len(ours), len(theirs)) and same_weights(ours[shared], theirs[shared]):
            shared += 1
    if shared == len(ours) == len(theirs) and same_weights(companion.get_output_embeddings(), draft.get_output_embeddings()):
        return 0.0  # the draft itself: its logits are the draft's
    prefix = sum(p.numel() for layer in ours[:shared] for p in layer.parameters())
    return (weights_read_per_token(companion) - prefix) / weights_read_per_token(draft)


def head_forward_cost(head: torch.nn.Module, draft: torch.nn.Module) -> float:
    """An acceptance head's forward over one scored token in draft forwards: its weights read per token over the
    draft's (`weights_read_per_token`): the shipped on-time head (4.0 M parameters) costs 0.0315 of its draft, SmolLM2-135M
    without layers 20-21 (127.4 M weights read per token). A signal the draft already computed (its confidence, entropy)
    costs nothing."""
    return weights_read_per_token(head) / weights_read_per_token(draft)


@dataclass
class Companion:
    """A companion model, the bins profiled for it and what one of its forwards costs in draft forwards
    (`forward_cost`): what the round engine needs to run SV's predictor."""

    model: Any
    table: BinTable
    cost: float = 1.0

    def score(self, logq_all: torch.Tensor, logc_all: torch.Tensor, token: int) -> float:
        """SV's prediction for a drafted `token` from the draft's and the companion's log-probabilities at its step."""
        s, a = agreement(logq_all.exp(), logc_all.to(logq_all.device).exp(), torch.tensor(token, device=logq_all.device))
        return float(self.table.predict(np.array([float(s)]), np.array([float(a)]))[0])
