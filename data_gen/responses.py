"""Responses: sampled from the target with batched `generate`, or imported from another engine's JSONL."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from specheads.data_gen.plan import WorkItem
from specheads.data_gen.prompts import read_jsonl
from specheads.errors import UsageError
from specheads.sampling import SamplingTransform, draw_from_log_probs, row_generator, uniforms


class RowSeededSampler(LogitsProcessor):
    """Samples each row's next token from the transformed distribution with that row's own generator.

    It returns scores that are -inf everywhere but the drawn token, so greedy `generate` emits exactly
    the draw: each row's response depends on its seed alone, not on its neighbours in the batch.
    """

    def __init__(self, transform: SamplingTransform, seeds: list[int]):
        self.transform = transform
        self.generators = [row_generator(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        draws = torch.cat([uniforms(g, 1) for g in self.generators])
        tokens = draw_from_log_probs(self.transform.log_probs(scores), draws)
        chosen = torch.full_like(scores, -math.inf)
        return chosen.scatter_(-1, tokens.unsqueeze(-1), 0.0)


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a response (the model's generation config, else the tokenizer's EOS)."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    ids = [i for i in ids if i is not None] or [tokenizer.eos_token_id]
    return ids


def cut_at_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    """Tokens up to and including the first stop token."""
    for position, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: position + 1]
    return tokens


def generate_responses(
    model: Any, tokenizer: Any, items: list[WorkItem], transform: SamplingTransform,
    max_new_tokens: int, response_seeds: list[int], device: torch.device,
) -> list[list[int]]:
    """One sampled response per item, generated as one left-padded batch."""
    pad_id = tokenizer.pad_token_id
    width = max(len(item.prompt_ids) for item in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        input_ids[row, width - len(item.prompt_ids):] = torch.tensor(item.prompt_ids)
        attention_mask[row, width - len(item.prompt_ids):] = 1
    stop_ids = stop_token_ids(model, tokenizer)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id)
    output = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config,
        logits_processor=LogitsProcessorList([RowSeededSampler(transform, response_seeds)]),
    )
    return [cut_at_stop(row.tolist(), stop_ids) for row in output[:, width:].cpu()]


def load_imported_responses(path: Path, tokenizer: Any, known_ids: set[str], max_new_tokens: int) -> dict[str, list[list[int]]]:
    """Responses from a JSONL of `{"id", "response" | "response_ids", "finish_reason"?}`, grouped by prompt id.

    Text is tokenized without special tokens, and the EOS token is appended when the engine stopped
    on it (`finish_reason` "stop", the default). Responses are cut to `max_new_tokens`.
    """
    grouped: dict[str, list[list[int]]] = defaultdict(list)
    unknown: list[str] = []
    for number, record in read_jsonl(path):
        where = f"{path}:{number}"
        if not isinstance(record, dict) or "id" not in record:
            raise UsageError(f"{where}: expected an object with the prompt `id` and `response` or `response_ids`")
        prompt_id = str(record["id"])
        if prompt_id not in known_ids:
            unknown.append(prompt_id)
            continue
        if "response_ids" in record:
            ids = record["response_ids"]
            if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < len(tokenizer) for t in ids):
                raise UsageError(f"{where}: `response_ids` must be a list of integer token ids below {len(tokenizer)} "
                                 "(no booleans, floats or strings); fix that line")
        elif isinstance(record.get("response"), str):
            ids = list(tokenizer(record["response"], add_special_tokens=False)["input_ids"])
            if record.get("finish_reason", "stop") == "stop":
                ids.append(tokenizer.eos_token_id)
        else:
            raise UsageError(f"{where}: no `response` text or `response_ids`; add one")
        if not ids:
            raise UsageError(f"{where}: the response is empty; drop the line or give the response")
        grouped[prompt_id].append(ids[:max_new_tokens])
    if unknown:
        raise UsageError(
            f"{path} names {len(unknown)} prompt id(s) not in the prompt set (first: {unknown[0]!r}); "
            "pass the prompts the responses were made from (--prompts) or fix the ids"
        )
    return dict(grouped)
