"""A CPU model's linear layers with their weights prepacked once for oneDNN, as torch's inductor packs them when it
freezes a model for the CPU.

`torch.nn.functional.linear` in float32 on the CPU calls MKL's sgemm, which repacks the weight on every call of more
than one row: on one thread a forward of SmolLM2-135M over the 3 tokens a K = 2 verify reads costs 1.9 one-token
forwards, 5 tokens 1.7, and a one-token forward streams the weights at ≈ 13 GB/s. From a weight packed once the
forward is memory-bound as it should be: 3 tokens cost 1.08 one-token forwards, 8 tokens 1.3, and the one-token
forward itself is 1.5× faster (docs/benchmarks.md, "Why a verify cost two target forwards"). The values are the same
matrix products, rounded in another order.

Only a CPU float32 forward without autograd reads the packed copy; anything else (another device or dtype, a
gradient) takes the layer's own path, and a weight changed in place or replaced is repacked at its next forward. The
packed copies take as much memory again as the packed weights.
"""

from __future__ import annotations

from typing import Any

import torch

PACKED_ROWS = 4
"""The rows oneDNN packs for (a verify's K + 1 tokens); any row count runs on the packed weight."""


def packing_available() -> bool:
    """Whether this torch has oneDNN's prepacked linear (its CPU builds for x86 and ARM do)."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._reorder_linear_weight is not None
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose CPU float32 forward without autograd reads a oneDNN-prepacked copy of its weight (the
    module docstring); made by `pack_linear_weights`, which changes a layer's class in place."""

    packed: torch.Tensor | None = None
    packed_from: tuple[int, int] | None = None  # (data pointer, version) of the weight the copy was packed from
    packed_rows: int = PACKED_ROWS

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.packed_from != (weight.data_ptr(), weight._version):
            self.pack()
        if self.packed is None or not input.is_cpu or input.dtype != torch.float32 or (
                torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)):
            return super().forward(input)
        return torch.ops.mkldnn._linear_pointwise(input, self.packed, self.bias, "none", [], "")

    def pack(self) -> None:
        """Pack the weight as it is now (none for a weight off the CPU or not in float32)."""
        weight = self.weight.detach()
        packable = weight.is_cpu and weight.dtype == torch.float32
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.packed_rows) if packable else None
        self.packed_from = (weight.data_ptr(), weight._version)

    def __getstate__(self) -> dict[str, Any]:
        """Without the packed copy (oneDNN's tensors cannot be copied): a copy repacks at its first forward."""
        state = dict(super().__getstate__())
        state.pop("packed", None)
        state.pop("packed_from", None)
        return state


def pack_linear_weights(model: torch.nn.Module, rows: int = PACKED_ROWS) -> int:
    """Make every `nn.Linear` of `model` on the CPU in float32 a `PackedLinear` packed for `rows` rows, in place; the
    number of layers made so (0 where oneDNN is not available). Tied weights stay tied: the parameters are the layers'
    own."""
    if not packing_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = PackedLinear
            module.packed_rows = rows
            module.pack()
            count += 1
    return count
