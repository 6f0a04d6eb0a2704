"""Gen's checks of a config's placement, before Lightning starts a process (the placement itself: specheads.placement)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specheads.errors import UsageError
from specheads.models import derived_draft
from specheads.placement import check_spec_placement

if TYPE_CHECKING:
    from specheads.data_gen.config import GenConfig


def trainer_devices(devices: int, gpus_per_rank: int) -> int | list[int]:
    """Lightning's `devices`: a count, or with several GPUs per rank each rank's first GPU `[0, G, 2G, …]`."""
    return devices if gpus_per_rank == 1 else [rank * gpus_per_rank for rank in range(devices)]


def check_placement(config: GenConfig) -> None:
    """Refuse placements that cannot work, from the config alone (nothing loaded, no GPU needed)."""
    if config.gpus_per_rank > 1:
        if config.accelerator == "cpu":
            raise UsageError(f"gpus_per_rank {config.gpus_per_rank} needs GPUs but accelerator is cpu; "
                             "set accelerator gpu (or auto), or gpus_per_rank 1")
        if config.target.device_map is None and config.draft.device_map is None:
            raise UsageError(f"gpus_per_rank {config.gpus_per_rank} gives each rank GPUs that no model would use; "
                             "set target.device_map auto to spread the target over them, or gpus_per_rank 1")
    if derived_draft(config.draft) and (config.draft.device_map is not None or config.draft.max_memory is not None):
        raise UsageError("draft.device_map and draft.max_memory do not apply to a draft derived from the target "
                         "(draft.skip_layers): it shares the target's weights where they are; drop them and set target.device_map")
    for role, spec in (("target", config.target), ("draft", config.draft)):
        check_spec_placement(role, spec, config.gpus_per_rank)


def check_visible_gpus(config: GenConfig) -> None:
    """Refuse more GPUs per node than the node shows (before Lightning starts any process)."""
    if config.gpus_per_rank == 1:
        return
    visible = torch.cuda.device_count()
    needed = config.devices * config.gpus_per_rank
    if needed > visible:
        fix = (f"lower devices (ranks per node) to {visible // config.gpus_per_rank}" if visible >= config.gpus_per_rank
               else f"lower gpus_per_rank to {visible}" if visible else "run on a GPU node")
        raise UsageError(f"devices {config.devices} x gpus_per_rank {config.gpus_per_rank} needs {needed} GPUs on each "
                         f"node but this one shows {visible}; {fix}, and check CUDA_VISIBLE_DEVICES (every rank "
                         "must see all the node's GPUs)")
