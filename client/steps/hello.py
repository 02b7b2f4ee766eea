"""What the planner is told once a profile is complete: the hello, and what it is built from."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Collection, Sequence
from typing import Any

from torch import nn

from rematd import __version__
from rematd.client.blocks.compiled import COMPILED_MODES
from rematd.client.blocks.parts import PART_MODES
from rematd.client.blocks.profiling import HostLink, alike_seconds, host_bandwidth
from rematd.client.blocks.switchable import SwitchableBlock
from rematd.client.memory.accounting import SavedTensorAccounting, local_part, tensors_in
from rematd.client.memory.sources import CudaMemory, MemorySample, SavedTensorMemory, outside_blocks
from rematd.client.service.credential import job_credential
from rematd.planner import Mode, Option, Shape, Size, Term, peak_of
from rematd.planner.messages import BlockProfile, Hello

log = logging.getLogger("rematd.client")

Memory = CudaMemory | SavedTensorMemory


@dataclasses.dataclass(slots=True, kw_only=True)
class Identity:
    """Who is asking: the parts of the hello that do not come from the profiling step."""

    job: str
    fingerprint: str
    margin_ratio: float


def memory_source(
    model: nn.Module, accounting: SavedTensorAccounting, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Memory:
    """The CUDA allocator when the first step's input (or the model) is on CUDA; else saved-tensor accounting."""
    for t in tensors_in([args, kwargs]):
        if t.is_cuda:
            return CudaMemory(t.device)
    for p in model.parameters():
        if p.is_cuda:
            return CudaMemory(p.device)
        break
    return SavedTensorMemory(accounting)


def link_bandwidth(memory: Memory) -> float | None:
    """Bytes per second of the link offload copies over: measured on CUDA; None elsewhere, or where measuring
    failed (without it offload cannot be priced; the other modes still can)."""
    if not isinstance(memory, CudaMemory):
        return None
    try:
        return host_bandwidth(memory.device)
    except Exception as err:
        log.warning("rematd: measuring the host link failed (%s); offload is not offered", err)
        return None


def offer_modes(blocks: Sequence[SwitchableBlock], memory: Memory, modes: Collection[Mode]) -> None:
    """Offload needs a host link worth using: offered on CUDA only, with its measured bandwidth."""
    offer = set(modes)
    bandwidth = link_bandwidth(memory) if Mode.OFFLOAD in offer else None
    if not bandwidth:
        offer.discard(Mode.OFFLOAD)
    for b in blocks:
        own = {m for m in offer if m not in PART_MODES or m in b.parts}
        if b.compiled is not None:
            # A mode without a compiled variant would run its block eagerly among compiled ones.
            own &= {*COMPILED_MODES, Mode.OFFLOAD, Mode.COMPRESS}
        b.offer = frozenset(own)
        ahead = b.offloader.config.prefetch_blocks if b.offloader is not None else 1
        b.host_link = HostLink(bandwidth, ahead) if bandwidth else None


def fresh_grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients a step will create on this rank: those of trainable parameters without one now
    (a sharded parameter's gradient is its shard's size)."""
    return sum(
        local_part(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None
    )


def complete_profile(blocks: Sequence[SwitchableBlock]) -> bool:
    """Whether every block has a profile; after an error in the profiling step, borrow the largest."""
    measured = [b.measure for b in blocks if b.measure is not None]
    if len(measured) == len(blocks):
        return True
    if not measured:
        return False  # nothing to plan from: every block keeps recomputing
    largest = max(measured, key=lambda m: m.saved_bytes)
    for b in blocks:
        if b.measure is None:
            b.measure = dataclasses.replace(largest)
    return True


def blocks_at_peak(records: Sequence[BlockProfile], modes: Sequence[Mode]) -> int:
    """What the blocks held at the profiling step's peak, by the planner's own model of a peak in backward
    order, the memory outside the blocks held throughout (as on CUDA), for the ``modes`` the step ran
    (recomputing every block, or storing every one where the profile could not run leanly)."""
    chosen = []
    for r, mode in zip(records, modes, strict=True):
        cost = next((c for c in r.modes if c.mode == mode), None)
        kept, transient = (cost.kept.bytes, cost.transient.bytes) if cost is not None else (r.saved_bytes, 0)
        chosen.append(Option(mode, kept, transient, 0.0, (r.in_flight - 1) * kept, r.stage))
    return peak_of(chosen) if chosen else 0


def other_activations(
    memory: Memory, sample: MemorySample, *, blocks_bytes: int, static: int, fresh_grads: int, gathered: int = 0
) -> Size:
    """Memory at the peak outside static memory and the blocks, from the profiling step. On the CPU, bytes the
    rest of the model saves, counted apart as they are saved (:attr:`MemorySample.outside_bytes`). On CUDA,
    what the allocator's peak holds beyond ``blocks_bytes``, what the blocks held then (:func:`blocks_at_peak`):
    logits, the loss's upcast, gradients as they accumulate, optimizer temporaries, allocator rounding.
    Gradients of parameters that had none at the step's start do not grow with the input; what the step
    created and kept (optimizer state) is later steps' static memory; the rest is taken to grow with tokens
    (:func:`rematd.client.memory.sources.outside_blocks`).

    ``gathered``: on CUDA, the parameters the parallel set-up holds gathered at the peak, a constant of the
    model's sharding, kept out of what grows with tokens. (On the CPU a sharded model's static bytes hold them.)"""
    if not isinstance(memory, CudaMemory):
        return Size.linear(sample.outside_bytes)
    outside = outside_blocks(
        peak=sample.peak_allocated_bytes,
        static=static,
        blocks=blocks_bytes,
        allocated_after=sample.allocated_bytes,
        fresh_grads=fresh_grads,
    )
    if not gathered:
        return outside
    # The allocator's peak held the gathered parameters: what it counted as growing with tokens holds them.
    growing = [t for t in outside.terms if t.batch_exp or t.seq_exp]
    constant = [t for t in outside.terms if not (t.batch_exp or t.seq_exp)]
    taken = min(gathered, sum(t.bytes for t in growing))
    left = sum(t.bytes for t in growing) - taken
    terms = [*constant, Term(taken, 0, 0)] if taken else constant
    return Size(tuple([*terms, *([Term(left, 1, 1)] if left else [])]))


def build_hello(
    who: Identity,
    blocks: Sequence[SwitchableBlock],
    memory: Memory,
    sample: MemorySample,
    *,
    rank: int,
    world_size: int,
    shape: Shape,
    budget_bytes: int,
    static: int,
    fresh_grads: int,
    gathered: int = 0,
    in_flight: Sequence[int] = (),
    other_in_flight: int = 1,
    stages: Sequence[int] = (),
    ran: Sequence[Mode] = (),
) -> Hello:
    """The hello that opens the planner, from the profiling step; the blocks stop profiling.

    ``in_flight``: per block, the microbatches whose activations of it are alive at once at the peak (a
    stage's; default one each); ``other_in_flight``: likewise for the memory outside the blocks, which the
    profiling step's peak holds for each of them, and the hello gives per microbatch; ``stages``: per block,
    which of the rank's stages it runs in; ``ran``: the modes the profiling step ran (default: storing)."""
    flights = tuple(in_flight) or (1,) * len(blocks)
    where = tuple(stages) or (0,) * len(blocks)
    records = tuple(
        dataclasses.replace(r, in_flight=m, stage=t) if (m, t) != (1, 0) else r
        for r, m, t in zip(block_records(blocks), flights, where, strict=True)
    )
    for b in blocks:
        b.profiling = False
    return Hello(
        job_id=who.job,
        rank=rank,
        world_size=world_size,
        device_name=memory.name,
        device_total_bytes=memory.total_bytes,
        model_fingerprint=who.fingerprint,
        blocks=records,
        profile_shape=shape,
        budget_bytes=budget_bytes,
        static_bytes=static,
        memory_source=memory.kind,
        margin_ratio=who.margin_ratio,
        client_version=__version__,
        job_secret=job_credential(),
        host=socket.gethostname()[:256],
        pid=os.getpid(),
        other_activations=_per_microbatch(
            other_activations(
                memory,
                sample,
                blocks_bytes=blocks_at_peak(records, tuple(ran) or (Mode.STORE,) * len(records)),
                static=static,
                fresh_grads=fresh_grads,
                gathered=gathered,
            ),
            other_in_flight,
        ),
        other_in_flight=other_in_flight,
    )


def _per_microbatch(other: Size, in_flight: int) -> Size:
    """What the memory outside the blocks holds per microbatch, of what ``in_flight`` of them held at once: the
    parts that grow with tokens, divided; the constant ones (gradients, gathered parameters) are counted once."""
    if in_flight == 1:
        return other
    growing = [Term(t.bytes // in_flight, t.batch_exp, t.seq_exp) for t in other.terms if t.batch_exp or t.seq_exp]
    constant = sum(t.bytes for t in other.terms if not (t.batch_exp or t.seq_exp))
    # The planner multiplies it all by in_flight: a constant part stands as its share of one microbatch.
    terms = [*growing, *([Term(constant // in_flight, 0, 0)] if constant else [])]
    return Size(tuple(t for t in terms if t.bytes))


def block_records(blocks: Sequence[SwitchableBlock]) -> tuple[BlockProfile, ...]:
    """Each block's profile as measured (zeros for a block without one), blocks alike priced alike
    (:func:`alike_seconds`)."""
    records = []
    for b, m in zip(blocks, alike_seconds([b.measure for b in blocks]), strict=True):
        records.append(
            BlockProfile(
                index=b.index,
                name=b.name,
                saved_bytes=m.saved_bytes if m else 0,
                input_bytes=m.input_bytes if m else 0,
                forward_seconds=m.forward_seconds if m else 0.0,
                modes=m.modes if m else (),
            )
        )
    return tuple(records)
