"""Which rank this process is, of how many: read from the default process group."""

from __future__ import annotations

import torch


def dist_rank() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
