"""Keys and values of prompts decoded before, so that decoding one again needs no prefill forward.

An eval decodes the same held-out prompts under every setting and again at every serving batch size; on a CPU the
prefill of a batch of chat prompts costs as much as decoding two dozen tokens after them. Each model (draft, target,
SV's companion) keeps its own entries, keyed by the prompt's tokens but the last: the last is fed in the row's first
round, whose forward gives the logits that round needs, so the forwards counted per request do not change. Entries are
keyed by the model object too, so one cache never hands a model another's keys. Bounded in bytes: once full, new
prompts are not stored (an eval visits its prompts in the same order under every setting, where evicting the oldest
would evict each entry just before its next use). Stored keys come from a batched forward, so a row that loads them
differs from one that prefilled in its own batch by float rounding only (identical tokens in float64,
tests/test_batched.py).
"""

from __future__ import annotations

from typing import Any

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]
"""Per decoder layer, the keys and values of a prompt's tokens, [heads, tokens, dim] each (`BatchCache.snapshot`)."""


class PromptCache:
    """Prompt prefixes' keys and values per model, up to `max_bytes` in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: dict[tuple[str, int, tuple[int, ...]], Layers] = {}
        self.bytes = 0
        self.hits = 0  # prefills a stored entry saved

    def get(self, name: str, model: Any, prefix: tuple[int, ...]) -> Layers | None:
        """The stored keys and values of `prefix` for `model`, the engine's `name` (`draft`, `target`, `companion`)."""
        layers = self.entries.get((name, id(model), prefix))
        if layers is not None:
            self.hits += 1
        return layers

    def put(self, name: str, model: Any, prefix: tuple[int, ...], layers: Layers) -> bool:
        """Store `layers` as `model`'s keys and values of `prefix`, unless that would pass the bound; whether the
        entry is held now."""
        size = nbytes(layers)
        key = (name, id(model), prefix)
        if key in self.entries:
            return True
        if self.bytes + size > self.max_bytes:
            return False
        self.entries[key] = layers
        self.bytes += size
        return True

    def holds(self, name: str, model: Any, prefix: tuple[int, ...]) -> bool:
        """Whether `prefix` is stored for `model` (not counted as a hit)."""
        return (name, id(model), prefix) in self.entries


def nbytes(layers: Layers) -> int:
    """The memory `layers` hold."""
    return sum(tensor.numel() * tensor.element_size() for pair in layers for tensor in pair)
