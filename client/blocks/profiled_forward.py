"""A block's profiling forward: its forward run once and measured (the tensors it saves, its time, what each
mode it offers would keep), leanly where this torch allows, as recomputing runs it, so that the profiling step
needs no more memory than recomputing every block."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematd.client.blocks.checkpoint_counting import count_checkpoint
from rematd.client.blocks.compress import Compressor, CompressProbe, constant_storages
from rematd.client.blocks.experts import rows_of
from rematd.client.blocks.parts import SwitchablePart
from rematd.client.blocks.profiling import WHOLE_REGION, BlockMeasure, HostLink, Profiler
from rematd.client.blocks.selective import Decide, TitanPolicy, megatron_policy
from rematd.client.memory.accounting import SavedTensorAccounting, tensors_in
from rematd.client.parallel.base import SetUp
from rematd.planner import Mode, Shape


class Profiled(Protocol):
    """What a block's profiling forward needs of it (:class:`rematd.client.blocks.switchable.SwitchableBlock`)."""

    module: nn.Module
    setup: SetUp
    compressor: Compressor | None
    offer: frozenset[Mode]
    profile_shape: Shape
    mode: Mode
    profiling: bool
    parts: dict[Mode, SwitchablePart]
    measure: BlockMeasure | None
    bank: nn.Module | None
    host_link: HostLink | None
    titan: TitanPolicy
    _accounting: SavedTensorAccounting | None
    _original: Callable[..., Any]
    _recording: Callable[..., Any] | None
    _in_forward: bool

    def _counting(self) -> SavedTensorAccounting | None: ...
    def _compiled_checkpoint(self, mode: Mode) -> bool: ...
    def _keeps_for_cache(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool: ...
    def _run(self, mode: Mode, *args: Any, **kwargs: Any) -> Any: ...
    def _transient_bytes(self, mode: Mode) -> int: ...


def profiled(block: Profiled, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The block's forward, measured for the profile. Leanly where it can (:func:`_profiled_lean`): as
    recomputing keeps it, so that the profiling step needs no more memory than recomputing every block;
    else storing, every saved tensor seen by hooks of its own."""
    acct = block._accounting
    excluded = acct.excluded if acct is not None else frozenset()
    inputs = tensors_in([args, kwargs])
    cuda = any(t.is_cuda for t in inputs)
    gathered = block.setup.block_weights(block.module)
    probe = (
        CompressProbe(block.compressor.config, constant_storages(inputs), cuda)
        if block.compressor is not None and Mode.COMPRESS in block.offer
        else None
    )
    compiled = frozenset(m for m in WHOLE_REGION if block._compiled_checkpoint(m))
    profiler = Profiler(block.profile_shape, excluded, cuda, gathered, probe, _policies(block), compiled)
    counting = block._counting()
    if counting is not None and gathered:
        counting.gathered |= gathered
    lean = block.mode == Mode.RECOMPUTE and not block._keeps_for_cache(args, kwargs)
    for part in block.parts.values():
        part.recorder = profiler
    bank = (
        block.bank.register_forward_pre_hook(lambda _m, a: profiler.enter_bank(rows_of(a)))
        if block.bank is not None
        else None
    )
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        if lean:
            output = _profiled_lean(block, profiler, args, kwargs)
        else:
            output = _profiled_storing(block, profiler, counting, args, kwargs)
    except BaseException:
        # The outputs it collected hold the failed step's graph: let it go with the error.
        profiler.timer.clear()
        raise
    finally:
        for part in block.parts.values():
            part.recorder = None
        if bank is not None:
            bank.remove()
    if cuda:
        torch.cuda.synchronize()
    block.measure = profiler.result(inputs, time.perf_counter() - start, block.offer, block.host_link)
    profiler.timer.clear()
    block.profiling = False
    if lean:
        count_checkpoint(block, Mode.RECOMPUTE, args, kwargs, output, [])
    return output


def _policies(block: Profiled) -> dict[Mode, Decide]:
    """The op policies of the modes this block offers, each a fresh pass's decider, for the profile."""
    made: dict[Mode, Callable[[], Decide]] = {Mode.SELECTIVE: megatron_policy, Mode.TITAN: block.titan}
    return {mode: make() for mode, make in made.items() if mode in block.offer}


def _profiled_storing(
    block: Profiled,
    profiler: Profiler,
    counting: SavedTensorAccounting | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The block's forward storing everything, each saved tensor measured as autograd keeps it."""
    is_weight = block.setup.is_weight

    def pack(t: torch.Tensor) -> Any:
        profiler.count_saved()
        if is_weight is not None and is_weight(t):
            return t  # a weight the set-up gathered for this forward
        profiler.record(t)
        return counting.pack(t) if counting is not None else t

    with torch.autograd.graph.saved_tensors_hooks(pack, SavedTensorAccounting.unpack), profiler.timer:
        return block._original(*args, **kwargs)


def _profiled_lean(block: Profiled, profiler: Profiler, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The block's forward as recomputing runs it (a checkpoint that keeps its input only), each tensor the
    checkpoint's first pass would save measured on its way to the checkpoint, which keeps none of them:
    the profile a storing forward gives, at the memory of recomputing. Backward rematerialises the block,
    exactly as the recompute mode does."""
    is_weight = block.setup.is_weight

    def recording(*a: Any, **kw: Any) -> Any:
        hooks = top_saved_tensors_hooks()
        if hooks is None:
            raise RuntimeError("rematd: a checkpoint's first pass runs without its saved-tensor hooks")
        keep, give_back = hooks

        def pack(t: torch.Tensor) -> Any:
            profiler.count_saved()
            if is_weight is None or not is_weight(t):
                profiler.record(t)
                # Held until the block's forward ends, as its rematerialisation holds them in backward: a
                # storage freed at once would be reused, and counted once for two (keys are addresses).
                alive.append(t)
            return keep(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, give_back), profiler.timer:
            return block._original(*a, **kw)

    alive: list[torch.Tensor] = []
    block._recording = recording
    block._in_forward = True
    try:
        return checkpoint(functools.partial(block._run, Mode.RECOMPUTE), *args, use_reentrant=False, **kwargs)
    finally:
        block._in_forward = False
        block._recording = None
        alive.clear()


def top_saved_tensors_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The saved-tensor hooks in force (a checkpoint's, inside its region), or None; None as well where this
    torch cannot tell (the profile then stores: :func:`lean_profiling`)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    found = top(False)
    return None if found is None else (found[0], found[1])


def lean_profiling() -> bool:
    """Whether this torch lets a profile measure what a checkpoint's first pass saves (it reads the hooks in
    force, which torch exposes since 2.5): without, the profiling step stores every block."""
    return hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
