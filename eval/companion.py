"""SV's companion predictor (Speculative Verification §4.2; its signals S, A and bins in
`specheads.decoding.companion`), profiled on the drafted tokens of training rows (SV profiles 512 samples;
`PROFILE_ROWS` rows here) and scored offline on the head's held-out tokens, which it never reads for its bins.

On a self-speculative pair the companion is the target with another set of layers skipped (SV's LayerSkip setting
uses a deeper exit of the same model); `--sv-companion-skip-layers` names them.
"""

from __future__ import annotations

import datasets
import numpy as np
import torch

from specheads.decoding.companion import BinTable, agreement, profile
from specheads.model_outputs.sampling import SamplingTransform
from specheads.model_outputs.signals import output_logits

PROFILE_ROWS = 512
"""Rows of the training split the bins are profiled on (SV profiles 512 samples)."""


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
        logc = logc.to(logq.device)  # a split draft's and companion's last layers may sit on different devices
        for row, (prompt, drafted) in enumerate(zip(chunk["prompt_ids"], chunk["draft_ids"])):
            steps = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(drafted), device=logq.device)
            s, a = agreement(logq[row, steps].exp(), logc[row, steps].exp(),
                             torch.tensor(list(drafted), device=logq.device))
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
