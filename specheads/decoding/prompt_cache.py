"""Keys and values of prompts decoded before, so that decoding one again needs no prefill forward.

An eval decodes the same held-out prompts under every setting and again at every serving batch size; on a CPU the
prefill of a batch of chat prompts costs as much as decoding two dozen tokens after them. Each model (draft, target,
SV's companion) keeps its own entries, keyed by the prompt's tokens but the last: the last is fed in the row's first
round, whose forward gives the logits that round needs, so the forwards counted per request do not change. Bounded in
bytes, the least recently used entry going first. Stored keys come from a batched forward, so a row that loads them
differs from one that prefilled in its own batch by float rounding only (identical tokens in float64,
tests/test_batched.py).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]
"""Per decoder layer, the keys and values of a prompt's tokens, [heads, tokens, dim] each (`BatchCache.snapshot`)."""


class PromptCache:
    """Prompt prefixes' keys and values per model, up to `max_bytes` in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[str, tuple[int, ...]], Layers] = OrderedDict()
        self.bytes = 0
        self.hits = 0  # prefills a stored entry saved

    def get(self, model: str, prefix: tuple[int, ...]) -> Layers | None:
        """The stored keys and values of `prefix` for `model` (`draft`, `target`, `companion`), or None."""
        layers = self.entries.get((model, prefix))
        if layers is not None:
            self.entries.move_to_end((model, prefix))
            self.hits += 1
        return layers

    def put(self, model: str, prefix: tuple[int, ...], layers: Layers) -> None:
        """Store `layers` as `model`'s keys and values of `prefix`, dropping the least recently used entries beyond
        the bound (an entry larger than the whole bound is not stored)."""
        size = nbytes(layers)
        if (model, prefix) in self.entries or size > self.max_bytes:
            return
        self.entries[(model, prefix)] = layers
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= nbytes(dropped)


def nbytes(layers: Layers) -> int:
    """The memory `layers` hold."""
    return sum(tensor.numel() * tensor.element_size() for pair in layers for tensor in pair)
