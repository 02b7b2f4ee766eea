"""What rematd puts around a model's blocks, built once at ``attach``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from torch.utils.hooks import RemovableHandle

from rematd.client.blocks.batchnorm_stats import protect_running_stats
from rematd.client.blocks.compiled import CompiledBlocks
from rematd.client.blocks.compress import CompressConfig, Compressor
from rematd.client.blocks.kv_caches import train_without_cache
from rematd.client.blocks.mode_timing import RecomputeTimer
from rematd.client.blocks.offload import OffloadConfig, Offloader
from rematd.client.blocks.switchable import SwitchableBlock
from rematd.client.memory.accounting import SavedTensorAccounting
from rematd.client.plans.applier import PlanApplier

log = logging.getLogger("rematd.client")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockParts:
    """The switchable blocks and what they share: accounting, timing, offload, compiled variants, plans."""

    accounting: SavedTensorAccounting
    blocks: list[SwitchableBlock]
    timer: RecomputeTimer
    offloader: Offloader
    compiled: CompiledBlocks | None
    applier: PlanApplier
    hooks: list[RemovableHandle]
    """On the model: running statistics kept from recomputed forwards, no caches while training."""


def build_parts(
    model: nn.Module,
    found: Sequence[tuple[str, nn.Module]],
    *,
    hard_limit_bytes: int | None,
    compile_backend: str | None,
    compress: CompressConfig | None = None,
    offload: OffloadConfig | None = None,
) -> BlockParts:
    """Wrap each block found; ``compile_backend`` (a ``torch.compile`` backend) compiles their variants."""
    accounting = SavedTensorAccounting()
    accounting.hard_limit_bytes = hard_limit_bytes
    # Compiled blocks recompute whole: their parts keep the forward the compiler traces.
    parts = compile_backend is None
    blocks = [SwitchableBlock(i, name, m, accounting, parts=parts) for i, (name, m) in enumerate(found)]
    timer = RecomputeTimer()
    offloader = Offloader(timer, offload)
    compressor = Compressor(compress or CompressConfig(), accounting, timer)
    compiled = CompiledBlocks(compile_backend) if compile_backend is not None else None
    for b in blocks:
        b.timer = timer
        b.offloader = offloader
        b.compressor = compressor
        if compiled is None:
            continue
        if CompiledBlocks.supports(b):
            b.compiled = compiled
        else:
            log.warning("rematd: block %r has a forward set on the instance; it runs eagerly", b.name)
    return BlockParts(
        accounting=accounting,
        blocks=blocks,
        timer=timer,
        offloader=offloader,
        compiled=compiled,
        applier=PlanApplier(blocks),
        hooks=[*protect_running_stats([m for _, m in found]), *train_without_cache(model)],
    )
