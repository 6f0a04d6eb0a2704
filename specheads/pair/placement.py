"""Where a rank's models live: the whole model on the rank's device, or spread over the rank's GPUs by accelerate.

With `gpus_per_rank` G, a node runs `devices` data-parallel ranks (Lightning processes) and rank r owns GPUs
r·G .. r·G + G − 1 (Lightning's devices `[0, G, 2G, …]`: each rank's root device is the first GPU of its group).
A model spec with a `device_map` (`auto`, `balanced`, `balanced_low_0`, `sequential`, or an explicit
`{module: device}` map) is loaded by accelerate over those GPUs only, through a `max_memory` that names nothing
else. GPU numbers in a spec's `device_map` and `max_memory` count from the rank's first GPU (0 .. G − 1), so one
config serves every rank; `cpu` and `disk` name offloading, which accelerate's hooks bring back to the GPU for
each forward. Placement never changes a label: every layer runs whole, in the same order, on the same numbers, only
on another device of the same kind (tests/test_split_target.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specheads.plumbing.errors import UsageError

if TYPE_CHECKING:
    from specheads.pair.model_spec import ModelSpec

OFFLOAD = ("cpu", "disk")
PLACEMENT_FIELDS = ("device_map", "max_memory")
"""ModelSpec fields that say where a model runs, never what it computes (left out of the data fingerprint)."""


@dataclass(frozen=True)
class RankDevices:
    """One data-parallel rank's devices: `root` holds its unsplit models and its inputs; a `device_map` may use `gpus`."""

    root: torch.device
    gpus: tuple[int, ...]


def rank_devices(root: torch.device, gpus_per_rank: int) -> RankDevices:
    """The rank whose first device is `root` (Lightning's root device) owns `gpus_per_rank` GPUs from there."""
    if root.type != "cuda":
        return RankDevices(root, ())
    first = root.index or 0
    return RankDevices(root, tuple(range(first, first + gpus_per_rank)))


def visible_devices() -> RankDevices:
    """Outside a gen rank (train, eval): the first device, and every visible GPU for a device_map."""
    count = torch.cuda.device_count()
    return RankDevices(torch.device("cuda", 0) if count else torch.device("cpu"), tuple(range(count)))


def check_spec_placement(role: str, spec: ModelSpec, gpus_per_rank: int) -> None:
    """One spec's device_map and max_memory name only the rank's GPUs 0..G−1, cpu or disk, and a GGUF never disk."""
    if spec.max_memory is not None and spec.device_map is None:
        raise UsageError(f"{role}.max_memory is set but {role}.device_map is not; set {role}.device_map auto")
    named = list((spec.max_memory or {}).keys())
    if isinstance(spec.device_map, dict):
        named += list(spec.device_map.values())
    for device in named:
        if str(device) not in OFFLOAD and not (str(device).isdigit() and int(device) < gpus_per_rank):
            raise UsageError(f"{role} placement names device {device!r}; use a GPU of the rank, 0..{gpus_per_rank - 1} "
                             "(counted from the rank's first GPU), cpu or disk")
    if is_gguf(spec) and "disk" in map(str, named):
        raise UsageError(f"{role} is a GGUF file, which transformers cannot offload to disk; drop disk from its "
                         "placement or convert the model to safetensors")


def is_gguf(spec: ModelSpec) -> bool:
    """True when the spec names a GGUF file (from its strings alone)."""
    return bool(spec.gguf_file) or (spec.path or "").endswith(".gguf")


def load_kwargs(spec: ModelSpec, devices: RankDevices) -> dict[str, Any]:
    """`from_pretrained`'s `device_map` and `max_memory` for `spec` on `devices` (empty without a device_map)."""
    if spec.device_map is None:
        return {}
    if isinstance(spec.device_map, dict):
        return {"device_map": {name: rank_device(device, devices) for name, device in spec.device_map.items()}}
    if spec.max_memory is not None:
        max_memory = {rank_device(device, devices): amount for device, amount in spec.max_memory.items()}
    elif devices.gpus:  # only the rank's GPUs: never another rank's, never a silent offload
        max_memory = {gpu: torch.cuda.mem_get_info(gpu)[0] for gpu in devices.gpus}
    else:
        max_memory = None  # a CPU rank: accelerate's default, the free host memory
    return {"device_map": spec.device_map, "max_memory": max_memory}


def rank_device(device: int | str, devices: RankDevices) -> int | str:
    """A spec's device (the rank's GPU 0 .. G − 1, `cpu` or `disk`) as accelerate names it (the GPU's node index)."""
    if str(device) in OFFLOAD:
        return str(device)
    index = int(device)
    if index >= len(devices.gpus):
        raise UsageError(f"placement names GPU {index} of the rank but the rank has {len(devices.gpus)} GPU(s); "
                         "raise gpus_per_rank or name a GPU below it")
    return devices.gpus[index]


def check_no_spill(spec: ModelSpec, model: torch.nn.Module, devices: RankDevices) -> None:
    """Refuse a model that accelerate offloaded to cpu or disk where the spec did not allow it (a silent, large slowdown)."""
    if not isinstance(spec.device_map, str) or not devices.gpus:
        return
    allowed = {str(key) for key in (spec.max_memory or {})} & set(OFFLOAD)
    spilled = sorted({str(d) for d in getattr(model, "hf_device_map", {}).values() if str(d) in OFFLOAD} - allowed)
    if spilled:
        raise UsageError(f"{spec.describe()} does not fit on the rank's GPUs {list(devices.gpus)} (device_map "
                         f"{spec.device_map} put part of it on {' and '.join(spilled)}); raise gpus_per_rank, or allow the "
                         "offload (slow) by naming it in max_memory, e.g. {cpu: 200GiB}")


def offloaded_weights(model: torch.nn.Module) -> dict[int, Any]:
    """The offloaded-weight stores of accelerate's hooks, by id (a derived draft shares them, as it shares the weights)."""
    stores = (getattr(getattr(module, "_hf_hook", None), "weights_map", None) for module in model.modules())
    return {id(store): store for store in stores if store is not None}
