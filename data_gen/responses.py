"""Responses: sampled from the target with batched `generate`, or imported from another engine's JSONL."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import CompileConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache

from specheads.data_gen.plan import WorkItem
from specheads.dataset.prompts import encodable, read_jsonl
from specheads.model_outputs.sampling import SamplingTransform, draw_from_log_probs, row_generator, uniforms
from specheads.pair.models import cut_at_stop, stop_token_ids
from specheads.plumbing.errors import UsageError
from specheads.plumbing.private_apis import compile_on_every_device


class RowSeededSampler(LogitsProcessor):
    """Samples each row's next token from the transformed distribution with that row's own generator.

    It returns scores that are -inf everywhere but the drawn token, so greedy `generate` emits exactly
    the draw: each row's response depends on its seed alone, not on its neighbours in the batch. Each row's
    uniforms for all `steps` are drawn up front (the same values, in the same order, as one draw per step) and
    moved to the device once, so a decoding step costs no host work per row.
    """

    def __init__(self, transform: SamplingTransform, seeds: list[int], steps: int):
        self.transform = transform
        self.draws = torch.stack([uniforms(row_generator(seed), steps) for seed in seeds])
        self.step = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.draws.device != scores.device:
            self.draws = self.draws.to(scores.device)
        tokens = draw_from_log_probs(self.transform.log_probs(scores), self.draws[:, self.step])
        self.step += 1
        chosen = torch.full_like(scores, -math.inf)
        return chosen.scatter_(-1, tokens.unsqueeze(-1), 0.0)


CACHE_BUCKET = 64
"""A static KV cache's length is rounded up to a multiple of this, so that batches of nearby lengths share one
compiled decoding step while a batch of short prompts does not attend over the longest prompt's cache."""


def static_cache_length(prompt_width: int, max_new_tokens: int) -> int:
    """The static cache length for a batch: prompt plus response, rounded up to the bucket."""
    return -(-(prompt_width + max_new_tokens) // CACHE_BUCKET) * CACHE_BUCKET


def decoding_config(stop_ids: list[int], pad_id: int, max_new_tokens: int, compile: bool, device: torch.device) -> GenerationConfig:
    """Greedy `generate` over the sampler's one-hot scores; the decoding step compiled only when asked. The
    logit processors a model's own generation config may ask for (a repetition penalty, n-gram blocking, a minimum
    length) are switched off: `generate` fills every unset field from it, and they would reshape p."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                              disable_compile=not compile, repetition_penalty=1.0, no_repeat_ngram_size=0,
                              min_length=0, min_new_tokens=0)
    if compile:
        # transformers compiles on accelerators only unless told otherwise (its own switch for CPU runs)
        config.compile_config = compile_on_every_device(CompileConfig(), device.type == "cpu")
    return config


def generate_responses(
    model: Any, tokenizer: Any, items: list[WorkItem], transform: SamplingTransform,
    max_new_tokens: int, response_seeds: list[int], device: torch.device, cache: str = "dynamic", compile: bool = False,
) -> list[list[int]]:
    """One sampled response per item, generated as one left-padded batch, with a `dynamic` or `static` KV cache
    (`compile`: the decoding step compiled, static cache only)."""
    pad_id = tokenizer.pad_token_id
    width = max(len(item.prompt_ids) for item in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        input_ids[row, width - len(item.prompt_ids):] = torch.tensor(item.prompt_ids)
        attention_mask[row, width - len(item.prompt_ids):] = 1
    stop_ids = stop_token_ids(model, tokenizer)
    config = decoding_config(stop_ids, pad_id, max_new_tokens, compile, device)
    extra = {"cache": StaticCache(model.config, static_cache_length(width, max_new_tokens))} if cache == "static" else {}
    output = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config,
        logits_processor=LogitsProcessorList([RowSeededSampler(transform, response_seeds, max_new_tokens)]), **extra,
    )
    return [cut_at_stop(row.tolist(), stop_ids) for row in output[:, width:].cpu()]


@dataclass(frozen=True)
class ImportedResponse:
    """One imported response as the engine gave it: its tokens, and whether the engine stopped on a stop token that
    its text leaves out (`finish_reason` "stop" on a text response)."""

    ids: list[int]
    stopped: bool = False


@dataclass
class ImportedResponses:
    """Imported responses grouped by prompt id, each ending at its first stop token and at most `max_new_tokens`
    long; how many ran on past a stop token (`cut_at_stop`) or past `max_new_tokens` (`truncated`) and were cut."""

    by_prompt: dict[str, list[list[int]]]
    truncated: int = 0
    cut_at_stop: int = 0


def read_imported_responses(path: Path, tokenizer: Any, known_ids: set[str]) -> dict[str, list[ImportedResponse]]:
    """Responses from a JSONL of `{"id", "response" | "response_ids", "finish_reason"?}`, grouped by prompt id and
    checked line by line (text tokenized without special tokens); `finish_imported` makes them rows."""
    grouped: dict[str, list[ImportedResponse]] = defaultdict(list)
    unknown: list[str] = []
    for number, record in read_jsonl(path):
        where = f"{path}:{number}"
        if not isinstance(record, dict) or "id" not in record:
            raise UsageError(f"{where}: expected an object with the prompt `id` and `response` or `response_ids`")
        prompt_id = encodable(str(record["id"]), where, "the prompt id")
        if prompt_id not in known_ids:
            unknown.append(prompt_id)
            continue
        if "response_ids" in record:
            ids = record["response_ids"]
            if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < len(tokenizer) for t in ids):
                raise UsageError(f"{where}: `response_ids` must be a list of integer token ids below {len(tokenizer)} "
                                 "(no booleans, floats or strings); fix that line")
            response = ImportedResponse(list(ids))
        elif isinstance(record.get("response"), str):
            text = encodable(record["response"], where, "the response")
            response = ImportedResponse(list(tokenizer(text, add_special_tokens=False)["input_ids"]),
                                        stopped=record.get("finish_reason", "stop") == "stop")
        else:
            raise UsageError(f"{where}: no `response` text or `response_ids`; add one")
        if not response.ids and not response.stopped:
            raise UsageError(f"{where}: the response is empty; drop the line or give the response")
        grouped[prompt_id].append(response)
    if unknown:
        raise UsageError(
            f"{path} names {len(unknown)} prompt id(s) not in the prompt set (first: {unknown[0]!r}); "
            "pass the prompts the responses were made from (--prompts) or fix the ids"
        )
    return dict(grouped)


def finish_imported(responses: dict[str, list[ImportedResponse]], stop_ids: list[int], eos_id: int,
                    max_new_tokens: int) -> ImportedResponses:
    """The imported responses as rows, ended the way generated ones are (`cut_at_stop`): at their first stop token,
    kept; a text response the engine stopped on EOS gets that EOS back. Then cut to `max_new_tokens`. Both cuts are
    counted."""
    by_prompt: dict[str, list[list[int]]] = {}
    truncated = stopped_early = 0
    for prompt_id, group in responses.items():
        rows = by_prompt[prompt_id] = []
        for response in group:
            ids = cut_at_stop(response.ids, stop_ids)
            stopped_early += len(ids) < len(response.ids)
            if response.stopped and not (ids and ids[-1] in stop_ids):
                ids = [*ids, eos_id]
            truncated += len(ids) > max_new_tokens
            rows.append(ids[:max_new_tokens])
    return ImportedResponses(by_prompt, truncated, stopped_early)
