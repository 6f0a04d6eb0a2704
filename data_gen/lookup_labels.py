"""Labels for free drafts (`specheads gen --drafter.kind lookup|suffix`): no draft model, the proposal is read from the
verified context (prompt lookup / n-gram, or a suffix tree with frequency scores: `specheads.lookup.proposers`).

For each prompt the target writes its response y (greedy at T = 0, sampled at T > 0, with gen's own row seeds). Then
at every response position i (the verified context is the prompt and y_<i) the proposer proposes x_1..x_K, and each
proposed token gets

- its label: the acceptance probability of a point-mass draft, p(x_k | context, x_<k) under the decoding transform
  (1[x_k = the target's argmax] at T = 0), conditional on the earlier proposed tokens: one target forward over
  x_1..x_{K-1} on top of the verified context gives all of them (packed: all positions' proposals in a few forwards
  on top of one read of the response, each seeing only its own context);
- its token-only inputs (`specheads.lookup.features`), known before the verify: the proposal's statistics and the
  outcomes of the rounds before i of a decode that verifies every full proposal (`round_start` marks that decode's
  round starts). Because a point-mass draft is accepted exactly when the output token equals it, that decode's rounds
  follow from y alone: a round at s accepts the longest prefix of its proposal that y continues with, and ends one
  token later;
- optionally (`--target-states true`) the target's state at the last verified position (after the final norm), which
  the verify computes for free: `target_features` row i, the state that produced p for y_i.

Rows are written as gen's shards (Arrow, a record per shard, a manifest), and the same command resumes a killed run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from transformers import DynamicCache

from specheads import __version__
from specheads.data_gen.config import GenConfig
from specheads.data_gen.engines import BuiltinEngine
from specheads.data_gen.plan import Shard, WorkItem, build_plan
from specheads.data_gen.run import (
    Summary,
    arithmetic,
    fingerprint_of,
    prepare_output,
    refuse_foreign_folder,
    select_items,
    threads_kept,
)
from specheads.dataset.lookup import LOOKUP_FORMAT
from specheads.dataset.prompts import load_prompts, prompts_hash
from specheads.dataset.shards import read_record, shard_path, shard_problem
from specheads.dataset.store import FORMAT_VERSION, MANIFEST, write_shard
from specheads.lookup.features import FEATURE_NAMES, token_features
from specheads.lookup.proposers import accepted_prefix
from specheads.model_outputs.sampling import SamplingTransform
from specheads.model_outputs.signals import output_logits
from specheads.model_outputs.states import cache_argument, decoder_forward
from specheads.pair.models import (
    chat_template_hash,
    context_length,
    load_model,
    load_tokenizer,
    tokenizer_hash,
    weights_identity,
)
from specheads.pair.placement import rank_devices
from specheads.plumbing.files import check_output_folder, write_json_atomic
from specheads.plumbing.lock import folder_lock

LABELLER = 2
"""How the rows are made; raised when that changes, so older data is not resumed into."""


@dataclass
class ProposalInput:
    """A proposal made at response position `start` (verified context: the prompt and y_<start), its token inputs
    [K, F], and whether `start` is a round start of the decode that verifies every full proposal."""

    start: int
    proposal: Any
    features: np.ndarray
    round_start: bool


def ngram_proposer(prompt_length: int, depth: int, max_ngram: int, min_ngram: int) -> Any:
    """A request's proposer by prompt lookup: the context -> its n-gram proposal of at most `depth` tokens."""
    from specheads.lookup.proposers import ngram_propose

    return lambda context: ngram_propose(context, depth, prompt_length, max_ngram, min_ngram)


def proposal_inputs(prompt_ids: list[int], response: list[int], propose: Any) -> list[ProposalInput]:
    """The proposal and token inputs at every response position (module docstring); `propose(context)` gives a
    proposal from the verified context. Each input depends only on the prompt and y_<start."""
    inputs: list[ProposalInput] = []
    next_round = 0
    for start in range(len(response)):
        proposal = propose([*prompt_ids, *response[:start]])
        is_round = start == next_round
        if is_round:
            if proposal.tokens:
                next_round = start + accepted_prefix(proposal.tokens, response[start:]) + 1
            else:
                next_round = start + 1
        if proposal.tokens:
            inputs.append(ProposalInput(start, proposal, token_features(proposal), is_round))
    return inputs


PACKED_TOKENS = 512
"""Proposal tokens read in one target forward on top of the response (bounds the attention's memory)."""


def decoder_read(target: Any, tokens: list[int], cache: DynamicCache, device: torch.device,
                 mask: torch.Tensor | None = None, positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [L, V] float32, last-layer states after the final norm [L, h]) of `tokens` read on top of `cache`;
    `mask` [L, cached + L] (True: attends) and `positions` place them where a packed read needs them."""
    inputs: dict[str, Any] = {"input_ids": torch.tensor([tokens], device=device), "use_cache": True,
                              cache_argument(target): cache}
    if mask is not None:
        inputs |= {"attention_mask": mask[None, None].to(device), "position_ids": torch.tensor([positions], device=device)}
    _, states = decoder_forward(target, None, **inputs)
    return output_logits(target, states[0]), states[0]


def packed_mask(blocks: list[tuple[int, int]], before: int) -> torch.Tensor:
    """The attention of proposal blocks packed after `before` cached positions: a block (cached positions it sees, its
    length) sees those and its own earlier tokens, never another block. [packed, before + packed], True: attends."""
    total = sum(length for _, length in blocks)
    mask = torch.zeros(total, before + total, dtype=torch.bool)
    row = 0
    for seen, length in blocks:
        mask[row: row + length, :seen] = True
        mask[row: row + length, before + row: before + row + length] = torch.ones(length, length, dtype=torch.bool).tril()
        row += length
    return mask


def packed_groups(inputs: list[ProposalInput]) -> Iterator[list[ProposalInput]]:
    """The inputs whose proposals need a forward (two tokens or more), in groups of about PACKED_TOKENS tokens."""
    group: list[ProposalInput] = []
    for item in inputs:
        if len(item.proposal.tokens) < 2:
            continue
        group.append(item)
        if sum(len(x.proposal.tokens) - 1 for x in group) >= PACKED_TOKENS:
            yield group
            group = []
    if group:
        yield group


def reached_length(item: ProposalInput, response: list[int]) -> int:
    """How many of the proposal's tokens a decode can reach when the output is `response`: those that continue it and
    the first that departs from it (within the response)."""
    tokens = item.proposal.tokens
    return min(accepted_prefix(tokens, response[item.start:]) + 1, len(tokens), len(response) - item.start)


@torch.no_grad()
def label_row(target: Any, prompt_ids: list[int], response: list[int], inputs: list[ProposalInput],
              transform: SamplingTransform, device: torch.device,
              reached_only: bool = False) -> tuple[list[np.ndarray], torch.Tensor]:
    """(each input's labels [K], the target's states [n, h]: row i at the last verified position before y_i). One
    forward reads the prompt and the response; the proposals' tokens (all but their last) are then read on top of it,
    packed, each block seeing only its own verified context and its earlier tokens (`packed_mask`). With
    `reached_only` each proposal is labelled up to its first token that departs from the response
    (`reached_length`), all read off the response's own forward: at T = 0 no decode reaches a later token."""
    cache = DynamicCache(config=target.config)
    verified = [*prompt_ids, *response[:-1]]
    logits, states = decoder_read(target, verified, cache, device)
    first = len(prompt_ids) - 1  # the position that predicts y_1
    if reached_only:
        scored = {x.start: [logits[first + x.start: first + x.start + reached_length(x, response)]] for x in inputs}
    else:
        scored = {item.start: [logits[first + item.start][None]] for item in inputs}
    for group in [] if reached_only else packed_groups(inputs):
        blocks = [(len(prompt_ids) + x.start, len(x.proposal.tokens) - 1) for x in group]
        tokens = [t for x in group for t in x.proposal.tokens[:-1]]
        positions = [seen + j for seen, length in blocks for j in range(length)]
        extra, _ = decoder_read(target, tokens, cache, device, packed_mask(blocks, len(verified)), positions)
        cache.crop(-len(tokens))
        row = 0
        for item, (_, length) in zip(group, blocks):
            scored[item.start].append(extra[row: row + length])
            row += length
    labels = []
    for item in inputs:
        log_probs = transform.log_probs(torch.cat(scored[item.start]))
        tokens = item.proposal.tokens[: len(log_probs)]  # all of them, or those reached
        picked = log_probs.gather(-1, torch.tensor(tokens, device=log_probs.device)[:, None]).squeeze(-1)
        labels.append(picked.exp().cpu().numpy().astype(np.float32))
    return labels, states[first: first + len(response)].float().cpu()


def row_schema(target_hidden_size: int | None) -> datasets.Features:
    """The Arrow schema of a lookup row: one entry per labelled proposed token in the flat per-token columns."""
    ints = datasets.List(datasets.Value("int32"))
    schema: dict[str, Any] = {
        "prompt_id": datasets.Value("string"), "sample_index": datasets.Value("int32"),
        "prompt_ids": ints, "target_ids": ints,
        "start": ints, "position": ints, "token": ints,
        "label": datasets.List(datasets.Value("float32")),
        "round_start": datasets.List(datasets.Value("bool")),
        "token_features": datasets.Array2D(shape=(None, len(FEATURE_NAMES)), dtype="float32"),
    }
    if target_hidden_size:
        schema["target_features"] = datasets.Array2D(shape=(None, target_hidden_size), dtype="float16")
    return datasets.Features(schema)


def row_columns(item: WorkItem, response: list[int], inputs: list[ProposalInput], labels: list[np.ndarray],
                states: torch.Tensor | None) -> dict[str, Any]:
    """One row's values, by column: a proposed token for each label (`labels` may stop short of a proposal's end)."""
    width = len(FEATURE_NAMES)
    row: dict[str, Any] = {
        "prompt_id": item.prompt_id, "sample_index": item.sample_index, "prompt_ids": list(item.prompt_ids),
        "target_ids": response,
        "start": [x.start for x, kept in zip(inputs, labels) for _ in kept],
        "position": [k for kept in labels for k in range(1, len(kept) + 1)],
        "token": [int(t) for x, kept in zip(inputs, labels) for t in x.proposal.tokens[: len(kept)]],
        "label": np.concatenate(labels).tolist() if labels else [],
        "round_start": [x.round_start for x, kept in zip(inputs, labels) for _ in kept],
        "token_features": (np.concatenate([x.features[: len(kept)] for x, kept in zip(inputs, labels)]) if inputs
                           else np.zeros((0, width), np.float32)),
    }
    if states is not None:
        row["target_features"] = states.half().numpy()
    return row


def request_proposer(config: GenConfig, prompt_length: int) -> Any:
    """The proposer of one request of the run's free draft kind (`--drafter.kind`)."""
    option = config.drafter
    if option.kind == "lookup":
        return ngram_proposer(prompt_length, option.depth or DEFAULT_DEPTH, option.max_ngram, option.min_ngram)
    from specheads.lookup.proposers import SuffixProposer

    return suffix_proposer(partial(SuffixProposer, **option.suffix_settings()), prompt_length,
                           option.depth or DEFAULT_DEPTH)


DEFAULT_DEPTH = 8
"""Tokens a free draft proposes at most per round when `--drafter.depth` is not given."""


def suffix_proposer(cls: Any, prompt_length: int, depth: int) -> Any:
    """A request's suffix-tree proposer over its own prompt and output (the tree holds this request alone, so every row
    depends on its own prompt and response only and a resumed run labels alike): the context -> its proposal."""
    proposer = cls()
    state = {"started": False, "length": 0}

    def propose(context: list[int]) -> Any:
        if not state["started"]:
            proposer.start(0, context[:prompt_length])
            state["started"], state["length"] = True, prompt_length
        proposer.extend(0, context[state["length"]:])
        state["length"] = len(context)
        return proposer.propose(0, context, depth)

    return propose


def lookup_identity(config: GenConfig, target: Any, tokenizer: Any, prompts: list[Any], device: torch.device) -> dict:
    """What defines a lookup dataset: the target, the free draft and its settings, the transform, the prompts, the
    inputs' names and the arithmetic (gen's `data_identity` for a draft model)."""
    option = config.drafter
    draft = {"kind": option.kind, "depth": option.depth or DEFAULT_DEPTH}
    if option.kind == "lookup":
        draft |= {"max_ngram": option.max_ngram, "min_ngram": option.min_ngram}
    draft |= option.suffix_settings()
    if option.labels != "all":
        draft["labels"] = option.labels
    return {
        "target": weights_identity(config.target, target), "draft": draft,
        "tokenizer_hash": tokenizer_hash(tokenizer), "chat_template_hash": chat_template_hash(tokenizer),
        "sampling": {**config.sampling.transform().as_dict(), "max_new_tokens": config.sampling.max_new_tokens},
        "labeller": f"lookup-{LABELLER}", "seed": config.seed,
        "prompts": {"source": config.prompts, "split": config.prompts_split, "hash": prompts_hash(prompts),
                    "count": len(prompts)},
        "samples_per_prompt": config.samples_per_prompt, "responses": {"source": "target-generate"},
        "token_features": list(FEATURE_NAMES),
        **({"target_states": True, "target_hidden_size": int(target.config.hidden_size)} if config.target_states else {}),
        "long_prompts": config.long_prompts, "max_prompt_tokens": config.max_prompt_tokens,
        "batch_size": config.batch_size, "rows_per_shard": config.rows_per_shard,
        "arithmetic": arithmetic(device, config.threads, target.dtype),
    }


def label_shard(config: GenConfig, target: Any, engine: Any, shard: Shard, device: torch.device) -> dict[str, list]:
    """The columns of every row of `shard`: the responses (gen's engine, the rows' own seeds), then each row's labels."""
    transform = config.sampling.transform()
    columns: dict[str, list] = {}
    for batch in shard.batches:
        for item, response in zip(batch, engine.responses(target, batch, device, config.batch_size)):
            prompt = list(item.prompt_ids)
            inputs = proposal_inputs(prompt, response, request_proposer(config, len(prompt)))
            labels, states = label_row(target, prompt, response, inputs, transform, device,
                                       config.drafter.labels == "reached")
            row = row_columns(item, response, inputs, labels, states if config.target_states else None)
            for name, value in row.items():
                columns.setdefault(name, []).append(value)
    return columns


def lookup_statistics(out: Path, num_shards: int) -> dict[str, Any]:
    """Rows, labelled tokens and the mean label over the finished shards (their small columns only)."""
    rows = tokens = 0
    total = 0.0
    for index in range(num_shards):
        shard = datasets.Dataset.from_file(str(shard_path(out, index))).select_columns(["label"]).with_format("numpy")
        for labels in shard["label"]:
            total += float(np.sum(labels))
            tokens += len(labels)
        rows += len(shard)
    return {"rows": rows, "labelled_tokens": tokens, "mean_label": total / max(tokens, 1)}


def pending_shards(out: Path, shards: list[Shard], fingerprint: str) -> Iterator[Shard]:
    """The shards a resumed run still has to label: missing, or not this run's."""
    return (shard for shard in shards if shard_problem(out, shard.index, fingerprint, None, deep=False) is not None)


def run_lookup(config: GenConfig) -> Summary:
    """`specheads gen` with a free draft (`--drafter.kind lookup|suffix`): one process, every check before anything is
    written, resumable shard by shard; returns gen's Summary."""
    config.validate()
    out = Path(config.out)
    check_output_folder(out)
    all_prompts = load_prompts(config.prompts, config.prompts_split, config.prompts_column, column_flag="--prompts-column")
    prompts = all_prompts[: config.num_prompts] if config.num_prompts else all_prompts
    tokenizer = load_tokenizer(config.target)
    device = torch.device("cuda" if config.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu")
    with threads_kept():
        torch.set_num_threads(config.threads)
        target = load_model(config.target, rank_devices(device, 1))
        selection = select_items(config, tokenizer, prompts, None, context_length(target))
        shards = build_plan(selection.items, config.batch_size, config.rows_per_shard)
        identity = lookup_identity(config, target, tokenizer, prompts, device)
        fingerprint = fingerprint_of(identity)
        started = {"format": LOOKUP_FORMAT, "format_version": FORMAT_VERSION, "complete": False,
                   "fingerprint": fingerprint, "identity": identity, "target_name": config.target.describe(),
                   "draft_name": config.drafter.kind,
                   "plan": {"num_shards": len(shards), "rows": len(selection.items), "batch_size": config.batch_size,
                            "rows_per_shard": config.rows_per_shard},
                   "config": config.as_dict(), "tool_version": __version__}
        with folder_lock(out, "gen"):
            refuse_foreign_folder(out, config.overwrite)
            finished = prepare_output(out, fingerprint, identity, config.overwrite)
            if finished is not None:
                counts = finished["counts"]
                return Summary(out, counts["rows"], counts["labelled_tokens"], finished["mean_label"], None, True)
            write_json_atomic(out / MANIFEST, started)
            engine = BuiltinEngine(tokenizer, config.sampling.transform(), config.sampling.max_new_tokens, config.seed,
                                   config.generation)
            began, written = time.perf_counter(), 0
            schema = row_schema(int(target.config.hidden_size) if config.target_states else None)
            for shard in pending_shards(out, shards, fingerprint):
                columns = label_shard(config, target, engine, shard, device)
                write_shard(out, shard.index, columns, schema, fingerprint)
                written += sum(len(labels) for labels in columns["label"])
                if config.progress:
                    print(f"specheads gen: shard {shard.index + 1}/{len(shards)} labelled", file=sys.stderr)
            stats = lookup_statistics(out, len(shards))
            seconds = time.perf_counter() - began
            write_json_atomic(out / MANIFEST, {
                **started, "complete": True, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "shards": [read_record(out, index) for index in range(len(shards))],
                "counts": {**selection.counts(len(prompts), None), "rows": stats["rows"],
                           "labelled_tokens": stats["labelled_tokens"]},
                "skipped_prompt_ids": selection.skipped, "mean_label": stats["mean_label"]})
    return Summary(out, stats["rows"], stats["labelled_tokens"], stats["mean_label"],
                   written / seconds if written else None, skipped_prompts=len(selection.skipped))

