"""SV's companion predictor (Speculative Verification §4.2), scored offline on the head's held-out tokens.

A companion model runs beside the draft. For a drafted token ŷ at a step with draft distribution q and companion
distribution c (both under the decoding's sampling transform) SV observes two signals:
- S = Σ_v min(q_v, c_v): how well draft and companion agree at that step;
- A = min(1, c(ŷ)/q(ŷ)): the token's acceptance were the companion the target.
Each is cut into equal-count bins on a profiling set (SV: 10–30 bins of S, 10–20 of A) and the prediction for a
token is the mean acceptance of its (S, A) cell there. Here the profiling set is the drafted tokens of the training
prompts (SV profiles 512 samples; `PROFILE_ROWS` rows here), and the held-out tokens are only scored.

On a self-speculative pair the companion is the target with another set of layers skipped (SV's LayerSkip setting
uses a deeper exit of the same model); `--sv-companion-skip-layers` names them. A reads the drawn token, so SV's
predictor may end a round's drafting but not rank drafted positions for a verify budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import numpy as np
import torch

from specheads.sampling import SamplingTransform
from specheads.signals import output_logits

S_BINS, A_BINS = 20, 15
"""Bins of S and A (inside SV's ranges, 10–30 and 10–20)."""
PROFILE_ROWS = 512
"""Rows of the training split the bins are profiled on (SV profiles 512 samples)."""


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


@torch.no_grad()
def companion_signals(draft: torch.nn.Module, companion: torch.nn.Module, transform: SamplingTransform,
                      rows: datasets.Dataset, batch: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """(S, A) at every response position of each row: q and c conditioned on the prompt and the target's response
    before the position (as the labels are), A of the drafted candidate `draft_ids`. Rows are right-padded in a
    batch: a causal model's real positions never see the pads after them."""
    device = next(draft.parameters()).device
    result = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        contexts = [list(p) + list(t) for p, t in zip(chunk["prompt_ids"], chunk["target_ids"])]
        width = max(len(c) for c in contexts)
        ids = torch.zeros(len(contexts), width, dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, : len(context)] = torch.tensor(context)
        logq = transform.log_probs(output_logits(draft, draft.get_decoder()(input_ids=ids.to(device)).last_hidden_state))
        logc = transform.log_probs(output_logits(companion, companion.get_decoder()(input_ids=ids.to(device)).last_hidden_state))
        for row, (prompt, drafted) in enumerate(zip(chunk["prompt_ids"], chunk["draft_ids"])):
            steps = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(drafted))
            q, c = logq[row, steps].exp(), logc[row, steps].exp()
            token = torch.tensor(list(drafted), device=q.device).unsqueeze(1)
            s = torch.minimum(q, c).sum(-1)
            a = (c.gather(1, token) / q.gather(1, token).clamp_min(1e-30)).clamp(max=1.0).squeeze(1)
            result.append((s.double().cpu().numpy(), a.double().cpu().numpy()))
    return result


def sv_companion_scores(draft: torch.nn.Module, companion: torch.nn.Module, transform: SamplingTransform,
                        profile_rows: datasets.Dataset, scored_rows: datasets.Dataset,
                        rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, BinTable]:
    """SV's prediction for the scored tokens (`rows`, `positions` into `scored_rows`), from bins profiled on the drafted
    tokens of the first PROFILE_ROWS of `profile_rows`."""
    profiled = profile_rows.select(range(min(PROFILE_ROWS, len(profile_rows))))
    signals = companion_signals(draft, companion, transform, profiled)
    drafted = [np.asarray(flags, dtype=bool) for flags in profiled["is_draft"]]
    s = np.concatenate([sig[0][mask] for sig, mask in zip(signals, drafted)])
    a = np.concatenate([sig[1][mask] for sig, mask in zip(signals, drafted)])
    accept = np.concatenate([np.asarray(acc)[mask] for acc, mask in zip(profiled["accept"], drafted)])
    table = profile(s, a, accept)
    scored = companion_signals(draft, companion, transform, scored_rows)
    s_tokens = np.array([scored[r][0][p] for r, p in zip(rows, positions)])
    a_tokens = np.array([scored[r][1][p] for r, p in zip(rows, positions)])
    return table.predict(s_tokens, a_tokens), table
