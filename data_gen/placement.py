"""Gen's ranks on the node's GPUs, before Lightning starts a process: Lightning's `devices` and the check that the node
shows the GPUs the ranks need (the config's own placement checks: `GenConfig.check_placement`; the placement itself:
specheads.pair.placement)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specheads.plumbing.errors import UsageError

if TYPE_CHECKING:
    from specheads.data_gen.config import GenConfig


def trainer_devices(devices: int, gpus_per_rank: int) -> int | list[int]:
    """Lightning's `devices`: a count, or with several GPUs per rank each rank's first GPU `[0, G, 2G, …]`."""
    return devices if gpus_per_rank == 1 else [rank * gpus_per_rank for rank in range(devices)]


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
