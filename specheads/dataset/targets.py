"""Which response positions a head learns from, and its label there (docs/data.md "Which state a head reads").

Per-position tensors are [B, n] (padded; `valid` marks real positions). Position j (0-based) is the
candidate ŷ_{j+1}. Which state a head reads:
- `candidate_state` (SpecDec++'s head) reads features[j + 1], the state that has read ŷ_{j+1};
- `context_state` (the on-time head, SPRINTER's verifier) reads features[j], the state that produced q for it.
What it learns (its `purpose`):
- `stop` heads learn the soft label `accept[j]` = min(1, p/q), only where the candidate was mixed in
  (`is_draft[j]`);
- `expect` heads (the expected-acceptance head) learn the analytic label `beta[j]` = α = Σ_v min(p_v, q_v) at
  every position (it does not depend on which candidate was drawn); judged against the realised acceptance
  (`realised=True`) they are scored on the stop heads' tokens with `accept[j]`, so the two compare on the same tokens;
- `verify` heads (SPRINTER) learn 1[logq − logp ≤ log τ]. With `contexts="consistent"` they keep only
  positions whose whole prefix is target tokens (the label was computed on that prefix); `"all"` keeps
  every position.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from specheads.model_outputs.states import mixed_states
from specheads.plumbing.errors import UsageError

CANDIDATE_STATE = "candidate_state"
CONTEXT_STATE = "context_state"
STOP, EXPECT, VERIFY = "stop", "expect", "verify"
Contexts = Literal["consistent", "all"]


def token_targets(batch: dict[str, torch.Tensor], purpose: str, tau: float = 1.0,
                  contexts: Contexts = "consistent", realised: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [B, n] bool, label [B, n] float) for a head of `purpose`; `realised` judges an `expect` head against the
    drafted candidates' acceptance instead of its training label."""
    valid = batch["valid"]
    if purpose == STOP or (purpose == EXPECT and realised):
        return valid & batch["is_draft"], batch["accept"].float()
    if purpose == EXPECT:
        return valid, batch["beta"].float()
    if purpose != VERIFY:
        raise ValueError(f"unknown head purpose {purpose!r}")
    label = ((batch["logq"] - batch["logp"]) <= math.log(tau)).float()
    if contexts == "all":
        return valid, label
    drafted_before = torch.cumsum(batch["is_draft"].long(), dim=1) - batch["is_draft"].long()
    return valid & (drafted_before == 0), label


def head_inputs(batch: dict[str, torch.Tensor], features: torch.Tensor, reads: str, purpose: str,
                extra_features: list[str], tau: float = 1.0, contexts: Contexts = "consistent",
                embeddings: torch.nn.Module | None = None, realised: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(hidden, signals, candidate embedding, label, mask) of a batch's labelled positions, ready for a head.

    `features` are the stored (or freshly computed) draft states [B, n + 1, h]; `extra_features` names
    the draft signals the head reads, in its column order.
    """
    mask, label = token_targets(batch, purpose, tau, contexts, realised)
    if "state_kept" in batch and not head_states(batch["state_kept"], reads)[mask].all():
        raise UsageError(f"the head reads {reads} at positions whose draft state the data did not keep (features_at); "
                         "train online (--data.mode online) or label the data again with --features_at all")
    hidden = head_states(features, reads)[mask.to(features.device)]
    signals = torch.stack([batch[name] for name in extra_features], -1)[mask] if extra_features else None
    embedding = embeddings(batch["draft_ids"][mask].to(embeddings.weight.device)) if embeddings is not None else None
    return hidden, signals, embedding, label[mask], mask


def markov_argument(batch: dict[str, torch.Tensor], mask: torch.Tensor, reads: str, head: torch.nn.Module
                    ) -> dict[str, torch.Tensor]:
    """`{"markov_embedding": [tokens, R]}` at a batch's labelled positions for a head that reads a DSpark drafter's
    Markov embedding of the previous token (`markov_rank` > 0; stored as `markov_features`, aligned with the states),
    else `{}`: the keyword arguments the head's forward takes beside the others."""
    if not getattr(head, "markov_rank", 0):
        return {}
    if "markov_features" not in batch:
        raise UsageError(f"the head reads a DSpark drafter's Markov embedding (markov_rank {head.markov_rank}) but the "
                         "batch holds none; label the data with a DSpark drafter (`specheads gen --drafter.kind dspark`) "
                         "or set model.head_args.markov_rank 0")
    return {"markov_embedding": head_states(batch["markov_features"], reads)[mask.to(batch["markov_features"].device)]}


def stale_target_states(batch: dict[str, torch.Tensor], mask: torch.Tensor, max_staleness: int,
                        seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(target state [tokens, h_target], staleness k [tokens]) for a batch's labelled positions (`mask`): the target's
    stored state at row j − k for the candidate at position j, as a decoder has it when that candidate is the k-th of
    its round (the target last verified the position k before the state that produced q). k is drawn uniformly from
    1..`max_staleness` (from the global generator while training; a fixed draw for a `seed`, for validation and
    evaluation) and cut to j: rows before the prompt's last are not stored."""
    rows, positions = mask.nonzero(as_tuple=True)
    if "target_features" not in batch:
        raise UsageError("the head reads the target's state but the batch holds none; label the data with "
                         "`specheads gen --target_states true` (offline mode)")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    drawn = torch.randint(1, max_staleness + 1, positions.shape, generator=generator).to(positions.device)
    staleness = torch.minimum(drawn, positions)
    states = batch["target_features"].to(mask.device)[rows, positions - staleness]
    return states, staleness


def head_states(features: torch.Tensor, reads: str) -> torch.Tensor:
    """The states aligned with positions [B, n, h] from features [B, n + 1, h] (row 0 = prompt's last)."""
    return features[:, 1:] if reads == CANDIDATE_STATE else features[:, :-1]


@torch.no_grad()
def draft_features(draft: torch.nn.Module, batch: dict, width: int, state_layer: int | None = None) -> torch.Tensor:
    """The draft's states (at `state_layer`) on a batch's prompt + mixed tokens, padded like stored features:
    [B, width + 1, h]."""
    device = next(draft.parameters()).device
    states = mixed_states(draft, batch["prompt_ids"], batch["mixed_ids"], 0, device, state_layer)
    features = torch.zeros(len(states), width + 1, states[0].shape[-1], device=device)
    for row, state in enumerate(states):
        features[row, : len(state)] = state
    return features
