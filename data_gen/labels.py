"""Per-position labels (docs/data.md "Rows"): candidates from q, log p, log q, acceptance, beta, entropy, and, on
request, a tree's second child (`sibling_*`).

Vocabulary-sized tensors only ever exist for `chunk` positions of one row at a time, so peak memory
is bounded by one batch of hidden states plus a few [chunk, vocab] tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specheads.data_gen.plan import WorkItem, row_seed
from specheads.dataset.shards import LIMITS
from specheads.dataset.storage import DEFAULT_STORAGE, FeatureStorage
from specheads.decoding.sampler import NON_FINITE_CAUSE, residual
from specheads.model_outputs.sampling import SamplingTransform, draw_from_log_probs, row_generator, uniforms
from specheads.model_outputs.signals import output_logits, signal_log_probs, signal_statistics
from specheads.model_outputs.states import decoder_states, mixed_states
from specheads.plumbing.errors import UsageError


@dataclass
class PositionLabels:
    """The labels of one row's response positions (all tensors of length n, on the CPU)."""

    draft_ids: torch.Tensor
    logp: torch.Tensor
    logq: torch.Tensor
    accept: torch.Tensor
    beta: torch.Tensor
    entropy: torch.Tensor
    top1: torch.Tensor
    top2: torch.Tensor  # the second-largest q of the signal distribution: with top1, the top-2 margin
    sibling_ids: torch.Tensor | None = None
    sibling_accept: torch.Tensor | None = None
    sibling_beta: torch.Tensor | None = None
    sibling_logq: torch.Tensor | None = None


SIBLING_COLUMNS = ("sibling_ids", "sibling_accept", "sibling_beta", "sibling_logq")


def sibling_labels(logp_all: torch.Tensor, logq_all: torch.Tensor, candidates: torch.Tensor,
                   draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree's second child at each position, as recursive rejection sampling checks it once the drafted candidate
    ŷ was rejected: x₂ drawn from q₂ = q without ŷ (renormalised), accepted with min(1, p₂(x₂)/q₂(x₂)), where
    p₂ = norm(max(0, p − q)); the acceptance known before x₂ is drawn, Σ min(p₂, q₂); and log q(x₂) under the whole
    q, the signal a head reads of a tree's child. Returns (x₂, its acceptance, Σ min(p₂, q₂), log q(x₂)); where q
    has no other token, x₂ is −1 and the rest 0."""
    rest = logq_all.scatter(-1, candidates.unsqueeze(-1), float("-inf"))
    has_rest = torch.isfinite(rest).any(-1)
    rest = torch.where(has_rest.unsqueeze(-1), rest, logq_all).log_softmax(-1)
    p_rest = residual(logp_all.exp(), logq_all.exp())
    second = draw_from_log_probs(rest, draws)
    q_second = rest.gather(-1, second.unsqueeze(-1)).squeeze(-1).exp()
    accept = (p_rest.gather(-1, second.unsqueeze(-1)).squeeze(-1) / q_second).clamp(max=1.0)
    beta = torch.minimum(p_rest, rest.exp()).sum(-1).clamp(max=1.0)
    logq_second = logq_all.gather(-1, second.unsqueeze(-1)).squeeze(-1)
    return (torch.where(has_rest, second, -1), torch.where(has_rest, accept, 0.0), torch.where(has_rest, beta, 0.0),
            torch.where(has_rest, logq_second, 0.0))


def label_positions(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, transform: SamplingTransform, draws: torch.Tensor,
    sibling_draws: torch.Tensor | None = None,
) -> PositionLabels:
    """Labels for a chunk of positions from raw logits [n, V]: candidate ŷ ~ q, then p and q statistics; with
    `sibling_draws`, a second child's labels too (`sibling_labels`)."""
    return labels_from_log_probs(transform.log_probs(target_logits), transform.log_probs(draft_logits), draft_logits,
                                 transform, draws, sibling_draws)


def labels_from_log_probs(
    logp_all: torch.Tensor, logq_all: torch.Tensor, draft_logits: torch.Tensor, transform: SamplingTransform,
    draws: torch.Tensor, sibling_draws: torch.Tensor | None = None,
) -> PositionLabels:
    """`label_positions` from p and q already transformed (`transform.log_probs`), with the draft's raw logits for
    the training-free signals."""
    candidates = draw_from_log_probs(logq_all, draws)
    logp = logp_all.gather(-1, candidates.unsqueeze(-1)).squeeze(-1)
    logq = logq_all.gather(-1, candidates.unsqueeze(-1)).squeeze(-1)
    beta = torch.minimum(logp_all, logq_all).exp_().sum(-1)
    logq_signal = signal_log_probs(draft_logits, logq_all, transform)
    entropy, top1, top2 = signal_statistics(logq_signal)
    siblings = ([t.cpu() for t in sibling_labels(logp_all, logq_all, candidates, sibling_draws)]
                if sibling_draws is not None else [None] * len(SIBLING_COLUMNS))
    return PositionLabels(
        draft_ids=candidates.cpu(), logp=logp.cpu(), logq=logq.cpu(),
        accept=(logp - logq).clamp(max=0.0).exp().cpu(), beta=beta.clamp(max=1.0).cpu(),
        entropy=entropy.cpu(), top1=top1.cpu(), top2=top2.cpu(),
        **dict(zip(SIBLING_COLUMNS, siblings)),
    )


LABEL_COLUMNS = ("logp", "logq", "accept", "beta", "entropy", "top1", "top2", "sibling_accept", "sibling_beta",
                 "sibling_logq", "drafter_score")
"""The computed labels checked before a row is kept (`refuse_bad_labels`), by the limits a shard's reader holds them to."""


def refuse_bad_labels(values: Mapping[str, Any], item: WorkItem) -> None:
    """Refuse a row whose labels break the limits a shard's reader checks (`specheads.dataset.shards.LIMITS`: NaN
    breaks every one), before its batch is written: one line naming the prompt, the column and the response position.
    Such labels come from non-finite logits (NaN weights, a float16 overflow), which would otherwise be written and
    gen exit 0."""
    for name in LABEL_COLUMNS:
        if name not in values or values[name] is None:
            continue
        array = np.asarray(values[name], dtype=np.float64)
        valid, what = LIMITS[name]
        bad = np.flatnonzero(~valid(array))
        if len(bad):
            position = int(bad[0])
            raise UsageError(f"prompt {item.prompt_id!r} (sample {item.sample_index}): its {name} label at response "
                             f"position {position} is {array[position]:g}, {what}: the target's or the draft's logits are "
                             f"not finite; {NON_FINITE_CAUSE}, then run gen again (finished shards are kept)")


def label_row(
    target: Any, draft: Any, target_states: torch.Tensor, draft_states: torch.Tensor,
    prompt_length: int, response_length: int, transform: SamplingTransform,
    generator: torch.Generator, chunk: int, sibling_generator: torch.Generator | None = None,
) -> PositionLabels:
    """Labels for one row: positions prompt_length-1 .. prompt_length+n-2 predict response tokens 1..n; a second
    child's too when `sibling_generator` (a stream of its own, so the other columns do not move) is given."""
    parts = []
    for start in range(0, response_length, chunk):
        stop = min(start + chunk, response_length)
        rows = slice(prompt_length - 1 + start, prompt_length - 1 + stop)
        parts.append(label_positions(
            output_logits(target, target_states[rows]), output_logits(draft, draft_states[rows]),
            transform, uniforms(generator, stop - start),
            None if sibling_generator is None else uniforms(sibling_generator, stop - start),
        ))
    return PositionLabels(*(None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
                            for name in PositionLabels.__dataclass_fields__))


LABELLER = 3
"""The labelling's version, part of the data fingerprint. 3 (issue 62): rows carry `top2`, the second-largest q, so
that a dataset's shards all hold it. 2 (issue 50): the mixing draws come from a stream of their own (`mixing_draws`),
so that a one-pass labeller (data_gen.onepass) can mix each position as it is sampled; 1 took them from the label
stream after the row's candidates."""


def mixing_draws(global_seed: int, item: WorkItem, n: int) -> torch.Tensor:
    """The row's mixing uniforms in [0, 1) for its first `n` positions (float64), from the row's own `mixing` stream:
    position i keeps the target token when its draw falls below the row's target_ratio."""
    generator = row_generator(row_seed(global_seed, item.prompt_id, item.sample_index, "mixing"))
    return torch.rand(n, generator=generator, dtype=torch.float64)


def mix_tokens(target_ids: torch.Tensor, draft_ids: torch.Tensor, target_ratio: float | torch.Tensor,
               draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token mixing: keep the target token where the mixing draw falls below `target_ratio` (one per row, or one per
    position), else the draft candidate. Returns (mixed ids, is_draft)."""
    is_draft = draws >= target_ratio
    return torch.where(is_draft, draft_ids, target_ids), is_draft


def label_batch(
    target: Any, draft: Any, items: list[WorkItem], responses: list[list[int]], transform: SamplingTransform,
    global_seed: int, pad_id: int, chunk: int, store_features: bool, device: torch.device,
    state_layer: int | None = None, storage: FeatureStorage = DEFAULT_STORAGE, store_target_states: bool = False,
    siblings: bool = False,
) -> dict[str, list]:
    """Label one batch of rows; returns columns ready for the Arrow writer (`features` at `state_layer`, the rows and
    dtype `storage` names; `target_features`, the target's last-layer states on the same tokens, with `store_target_states`;
    the `sibling_*` columns with `siblings`)."""
    sequences = [list(item.prompt_ids) + response for item, response in zip(items, responses)]
    target_states = decoder_states(target, sequences, pad_id, device)
    draft_states = decoder_states(draft, sequences, pad_id, device)
    columns: dict[str, list] = {name: [] for name in (
        "prompt_id", "sample_index", "target_ratio", "prompt_ids", "target_ids", "draft_ids", "mixed_ids",
        "is_draft", "logp", "logq", "accept", "beta", "entropy", "top1", "top2", *(SIBLING_COLUMNS if siblings else ()))}
    for row, (item, response) in enumerate(zip(items, responses)):
        generator = row_generator(row_seed(global_seed, item.prompt_id, item.sample_index, "label"))
        sibling_generator = (row_generator(row_seed(global_seed, item.prompt_id, item.sample_index, "sibling"))
                             if siblings else None)
        labels = label_row(target, draft, target_states[row], draft_states[row], len(item.prompt_ids),
                           len(response), transform, generator, chunk, sibling_generator)
        refuse_bad_labels({name: getattr(labels, name) for name in LABEL_COLUMNS if hasattr(labels, name)}, item)
        target_ids = torch.tensor(response)
        mixed_ids, is_draft = mix_tokens(target_ids, labels.draft_ids, item.target_ratio,
                                         mixing_draws(global_seed, item, len(response)))
        columns["prompt_id"].append(item.prompt_id)
        columns["sample_index"].append(item.sample_index)
        columns["target_ratio"].append(item.target_ratio)
        columns["prompt_ids"].append(list(item.prompt_ids))
        columns["target_ids"].append(response)
        columns["mixed_ids"].append(mixed_ids.tolist())
        columns["is_draft"].append(is_draft.tolist())
        for name in ("draft_ids", "logp", "logq", "accept", "beta", "entropy", "top1", "top2",
                     *(SIBLING_COLUMNS if siblings else ())):
            columns[name].append(getattr(labels, name).numpy())
    del target_states, draft_states
    if store_features:
        columns["features"] = mixed_features(draft, items, columns["mixed_ids"], pad_id, device, state_layer,
                                             storage, columns["is_draft"])
    if store_target_states:
        columns["target_features"] = mixed_features(target, items, columns["mixed_ids"], pad_id, device, None, storage,
                                                    columns["is_draft"])
    return columns


def mixed_features(draft: Any, items: list[WorkItem], mixed: list[list[int]], pad_id: int, device: torch.device,
                   state_layer: int | None = None, storage: FeatureStorage = DEFAULT_STORAGE,
                   is_draft: list[list[bool]] | None = None) -> list:
    """`mixed_states` as numpy arrays for the Arrow writer: the rows `storage` keeps (given each row's `is_draft`),
    in its dtype."""
    states = mixed_states(draft, [list(i.prompt_ids) for i in items], mixed, pad_id, device, state_layer)
    if storage.at != "all":
        states = [row[torch.from_numpy(storage.rows(flags)).to(row.device)] for row, flags in zip(states, is_draft)]
    return [storage.encode(row) for row in states]
