"""What a checkpointed block keeps and brings back in backward, on the CPU's accounting: a checkpoint keeps its
tensors outside autograd's saved variables, and what it rematerialises is made under hooks of its own, so both are
counted by hand."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from rematd.client.blocks.profiling import BlockMeasure
from rematd.client.memory.accounting import SavedTensorAccounting, tensors_in
from rematd.planner import Mode


class Counted(Protocol):
    """What is counted of a block (:class:`rematd.client.blocks.switchable.SwitchableBlock`)."""

    measure: BlockMeasure | None

    def _counting(self) -> SavedTensorAccounting | None: ...
    def _transient_bytes(self, mode: Mode) -> int: ...


def count_checkpoint(
    block: Counted,
    mode: Mode,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    kept: list[torch.Tensor],
) -> None:
    """On the CPU's accounting: what a checkpoint keeps lives outside autograd's saved variables, and what
    it brings back in backward is made under hooks of its own: both counted by hand."""
    acct = block._counting()
    if acct is None:
        return
    inputs, outputs = tensors_in([args, kwargs]), tensors_in([output])
    needed = block.measure.kept_needed.get(mode) if block.measure is not None else None
    if kept and needed is not None and len(needed) == len(kept):
        # Those backward does not need are let go once the recomputation has used them, as the block's
        # backward begins (the profile found which, in the forward's order).
        unneeded = [t for t, need in zip(kept, needed, strict=True) if not need]
        kept = [t for t, need in zip(kept, needed, strict=True) if need]
        acct.hold(unneeded, until_grad_of=outputs)
    acct.hold([*inputs, *kept], until_grad_of=inputs)
    acct.rematerialise(block._transient_bytes(mode), outputs, inputs)
