"""A CPU model's linear layers with their weights prepacked once for oneDNN, as torch's inductor packs them when it
freezes a model for the CPU.

`torch.nn.functional.linear` in float32 on the CPU calls MKL's sgemm, which repacks the weight on every call of more
than one row: on one thread a forward of SmolLM2-135M over the 3 tokens a K = 2 verify reads costs 1.9 one-token
forwards, 5 tokens 1.7, and a one-token forward streams the weights at ≈ 13 GB/s. From a weight packed once the
forward is memory-bound as it should be: 3 tokens cost 1.08 one-token forwards, 8 tokens 1.3, and the one-token
forward itself is 1.5× faster (docs/benchmarks.md, "Why a verify cost two target forwards"). The values are the same
matrix products, rounded in another order.

Only a CPU float32 forward without autograd reads the packed copy; anything else (another device or dtype, a
gradient) takes the layer's own path, and a weight changed in place or replaced is repacked at its next forward: a
write through the weight (its version counter), through a `.data` alias (which has a counter of its own, so the weight
notes every alias it hands out and repacks after each), `.data = …`, or a dtype or device round trip (`half()` then
`float()`, whose new storage may reuse the old address). Only a write the tensor never sees (through a NumPy array or
a raw pointer) goes unnoticed. The packed copies take as much memory again as the packed weights.
"""

from __future__ import annotations

import weakref
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


_DATA = torch._C.TensorBase.data


class WatchedWeight(torch.nn.Parameter):
    """A parameter that notes each `.data` alias it hands out or takes: an alias counts its writes apart from the
    parameter's own version, so a packed copy must see them to stay current (`stamp`)."""

    @property
    def data(self) -> torch.Tensor:
        alias = _DATA.__get__(self)
        self._noted().append(weakref.ref(alias))
        self.handed_out = getattr(self, "handed_out", 0) + 1
        return alias

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _DATA.__set__(self, value)
        self.handed_out = getattr(self, "handed_out", 0) + 1

    def __getstate__(self) -> dict[str, Any]:
        """Without the notes (weak references cannot be pickled): a copy is watched afresh by its layer."""
        return {key: value for key, value in self.__dict__.items() if key not in ("aliases", "handed_out")}

    def _noted(self) -> list[weakref.ref]:
        if "aliases" not in self.__dict__:
            self.aliases = []
        return self.aliases

    def stamp(self) -> tuple:
        """What changes whenever the values may have: the storage, dtype and version, the aliases handed out so far
        (one gone may have been written before it went), and the versions of those still alive."""
        live = [alias for alias in (ref() for ref in self._noted()) if alias is not None]
        self.aliases = [weakref.ref(alias) for alias in live]
        return (_DATA.__get__(self).data_ptr(), self.dtype, self.device, self._version, getattr(self, "handed_out", 0),
                tuple(alias._version for alias in live))


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose CPU float32 forward without autograd reads a oneDNN-prepacked copy of its weight (the
    module docstring); made by `pack_linear_weights`, which changes a layer's class in place."""

    packed: torch.Tensor | None = None
    packed_from: tuple | None = None  # the weight's `WatchedWeight.stamp` when the copy was packed
    packed_rows: int = PACKED_ROWS

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if type(weight) is not WatchedWeight or self.packed_from != weight.stamp():
            self.pack()
        if self.packed is None or not input.is_cpu or input.dtype != torch.float32 or (
                torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)):
            return super().forward(input)
        return torch.ops.mkldnn._linear_pointwise(input, self.packed, self.bias, "none", [], "")

    def pack(self) -> None:
        """Pack the weight as it is now (none for a weight off the CPU or not in float32); a weight replaced by a plain
        parameter (`load_state_dict(assign=True)`) is watched again, in place so that tied weights stay tied."""
        if type(self.weight) is torch.nn.Parameter:
            self.weight.__class__ = WatchedWeight
        weight = self.weight.detach()
        packable = weight.is_cpu and weight.dtype == torch.float32
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.packed_rows) if packable else None
        self.packed_from = self.weight.stamp() if type(self.weight) is WatchedWeight else None

    def _apply(self, fn: Any, recurse: bool = True) -> torch.nn.Module:
        """A conversion (`half()`, `to(…)`) drops the packed copy at once: it would hold the old weights' memory."""
        self.packed, self.packed_from = None, None
        return super()._apply(fn, recurse)

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
