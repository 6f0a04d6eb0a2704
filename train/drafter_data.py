"""The EAGLE-3 drafter's training data: the target's own responses to prompts, with the target features the drafter
reads (`specheads.pair.drafters.target_features`), in chunks written atomically and reused.

A chunk is one safetensors file of `chunk_prompts` prompts × `samples_per_prompt` responses, flat over tokens:
`input_ids` [T], `loss_mask` [T] (1 on response tokens), `aux` [T, 3h] (the three fused layers), `last` [T, h] (the
last layer before the final norm), `lengths` [n] and `prompt_index` [n] per sequence; its metadata records the seconds
it took. `manifest.json` holds what the data depends on; a folder made under other settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specheads.dataset.prompts import Prompt, encode_prompt
from specheads.pair.drafters import target_features
from specheads.pair.models import cut_at_stop, stop_token_ids
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import atomic_path, write_json_atomic

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Sequence:
    """One training sequence of a chunk: a view into its flat tensors."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor
    prompt_index: int


def chunk_path(folder: Path, index: int) -> Path:
    """Where chunk `index` lives."""
    return folder / f"chunk-{index:05d}.safetensors"


def check_manifest(folder: Path, settings: dict[str, Any]) -> None:
    """Write `settings` as the data folder's manifest, or refuse a folder whose manifest says otherwise (before any
    model runs)."""
    path = folder / "manifest.json"
    if path.is_file():
        recorded = json.loads(path.read_text())
        differs = sorted(key for key in {*recorded, *settings} if recorded.get(key) != settings.get(key))
        if differs:
            raise UsageError(f"{folder} holds drafter data made with other settings ({', '.join(differs)}); give another "
                             "--out, or remove that folder to make the data again")
        return
    write_json_atomic(path, settings)


def sample_responses(target: Any, tokenizer: Any, prompts: list[list[int]], samples: int, max_new_tokens: int,
                     temperature: float, seed: int) -> list[tuple[int, list[int]]]:
    """(prompt index, response ids up to and with the first stop token) for `samples` responses to every prompt, from
    the target's batched `generate` (sampled at `temperature`, no top-k/top-p; greedy at 0), seeded by `seed`."""
    device = next(target.parameters()).device
    rows = [index for index in range(len(prompts)) for _ in range(samples)]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, index in enumerate(rows):  # left padding: every row's next token is at the same column
        input_ids[row, width - len(prompts[index]):] = torch.tensor(prompts[index])
        attention[row, width - len(prompts[index]):] = 1
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}
    with torch.no_grad():
        output = target.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, **sampling)
    stops = stop_token_ids(target, tokenizer)
    return [(index, cut_at_stop(output[row, width:].tolist(), stops)) for row, index in enumerate(rows)]


def chunk_tensors(target: Any, tokenizer: Any, prompts: list[list[int]], responses: list[tuple[int, list[int]]],
                  layer_ids: list[int], dtype: torch.dtype, batch_size: int = 16) -> dict[str, torch.Tensor]:
    """The flat tensors of one chunk (see the module docstring) for `responses` to `prompts`."""
    device = next(target.parameters()).device
    sequences = [(index, prompts[index] + response) for index, response in responses]
    parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "loss_mask": [], "aux": [], "last": []}
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start:start + batch_size]
        width = max(len(tokens) for _, tokens in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, (_, tokens) in enumerate(batch):
            input_ids[row, :len(tokens)] = torch.tensor(tokens)
            attention[row, :len(tokens)] = 1
        aux, last = target_features(target, input_ids.to(device), attention.to(device), layer_ids)
        for row, (index, tokens) in enumerate(batch):
            size, prompt = len(tokens), len(prompts[index])
            parts["input_ids"].append(torch.tensor(tokens, dtype=torch.int32))
            parts["loss_mask"].append((torch.arange(size) >= prompt).to(torch.uint8))
            parts["aux"].append(aux[row, :size].to("cpu", dtype))
            parts["last"].append(last[row, :size].to("cpu", dtype))
    tensors = {name: torch.cat(values) for name, values in parts.items()}
    tensors["lengths"] = torch.tensor([len(tokens) for _, tokens in sequences], dtype=torch.int64)
    tensors["prompt_index"] = torch.tensor([index for index, _ in sequences], dtype=torch.int64)
    return tensors


def write_chunks(folder: Path, target: Any, tokenizer: Any, prompts: list[Prompt], chunk_prompts: int, samples: int,
                 max_new_tokens: int, temperature: float, seed: int, layer_ids: list[int], dtype: torch.dtype,
                 say: Any = print) -> list[Path]:
    """Every chunk of the data, made where missing (a finished chunk is kept: a stopped run resumes); their paths."""
    from safetensors.torch import save_file

    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    paths = []
    for index, start in enumerate(range(0, len(prompts), chunk_prompts)):
        path = chunk_path(folder, index)
        paths.append(path)
        if path.is_file():
            continue
        began = time.perf_counter()
        chunk = encoded[start:start + chunk_prompts]
        responses = sample_responses(target, tokenizer, chunk, samples, max_new_tokens, temperature, seed + index)
        tensors = chunk_tensors(target, tokenizer, chunk, responses, layer_ids, dtype)
        tensors["prompt_index"] += start
        seconds = time.perf_counter() - began
        with atomic_path(path) as temporary:
            save_file(tensors, temporary, metadata={"seconds": f"{seconds:.2f}"})
        tokens = int(tensors["loss_mask"].sum())
        say(f"data: chunk {index + 1}/{-(-len(prompts) // chunk_prompts)}: {len(responses)} responses, {tokens} response "
            f"tokens in {seconds:.0f} s ({tokens / seconds:.1f} tokens/s)")
    return paths


def read_sequences(path: Path) -> Iterator[Sequence]:
    """The sequences of one chunk."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    offset = 0
    for length, prompt_index in zip(tensors["lengths"].tolist(), tensors["prompt_index"].tolist()):
        window = slice(offset, offset + length)
        yield Sequence(tensors["input_ids"][window].long(), tensors["loss_mask"][window].bool(), tensors["aux"][window],
                       tensors["last"][window], prompt_index)
        offset += length


def chunk_seconds(paths: list[Path]) -> float:
    """The seconds the chunks took to make, as each recorded."""
    from safetensors import safe_open

    total = 0.0
    for path in paths:
        with safe_open(str(path), "pt") as handle:
            total += float((handle.metadata() or {}).get("seconds", 0))
    return total


def data_digest(paths: list[Path]) -> str:
    """A short sha256 over the chunks' bytes, in order: what identifies the data a drafter was trained on."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()[:16]
