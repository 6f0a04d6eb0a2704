"""The quality proxy of a decoding run: the target's own log-likelihood of the text it produced."""

from __future__ import annotations

from typing import Any

import torch

from specheads.model_outputs.signals import output_logits


@torch.no_grad()
def target_log_likelihoods(target: Any, prompts: list[list[int]], generated: list[list[int]]) -> list[float]:
    """Per run, the mean log-probability the target's own (untransformed) distribution gives its generated tokens
    (NaN for a run that generated none); the runs share one right-padded forward."""
    device = next(target.parameters()).device
    rows = [list(prompt) + list(tokens) for prompt, tokens in zip(prompts, generated)]
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
        mask[index, : len(row)] = 1
    states = target.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state
    results = []
    for index, (prompt, tokens) in enumerate(zip(prompts, generated)):
        if not tokens:
            results.append(float("nan"))
            continue
        log_probs = output_logits(target, states[index, len(prompt) - 1 : len(prompt) + len(tokens) - 1]).log_softmax(-1)
        results.append(float(log_probs.gather(-1, torch.tensor(tokens, device=log_probs.device).unsqueeze(-1)).mean()))
    return results
