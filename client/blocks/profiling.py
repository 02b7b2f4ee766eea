"""Measuring what each mode of a block costs, on one forward without checkpointing.

Every tensor saved for backward is classified by how its size scales with the
input: a dimension equal to the batch, to the sequence length, or to both
multiplied. Attention scores ([batch, heads, seq, seq]) scale with seq^2,
most activations with batch x seq, masks with seq^2 alone. One profile so
predicts every input shape.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rematd.client.blocks.compress import CompressProbe
from rematd.client.blocks.region_cost import region_cost
from rematd.client.blocks.selective import Decide, outputs_of
from rematd.client.memory.accounting import storage_bytes, storage_id, storage_key
from rematd.planner import Mode, ModeCost, Shape, Size, Term

Key = tuple[str, int]

WHOLE_REGION = frozenset({Mode.RECOMPUTE, Mode.SELECTIVE, Mode.TITAN})
"""Modes that checkpoint the whole block: its every saved tensor goes through the checkpoint's hooks."""


def exponents(t: torch.Tensor, shape: Shape) -> tuple[int, int]:
    """(batch exponent, sequence exponent) of a tensor's size.

    The batch is a dimension equal to it, or a leading one it divides (batch
    and heads folded together); the sequence exponent counts dimensions equal
    to the sequence length. When the sequence length equals a feature width
    of the block, a dimension of that size could be either: it is counted as
    sequence, which over-predicts long sequences rather than under-predicting
    them (safe, if wasteful; profile at a length no feature width equals to avoid it).
    """
    b, s = shape.batch, shape.seq_len
    dims = list(t.shape)
    eb = es = 0
    # A feature width can equal batch x sequence (a 4x MLP at b*s = 4d): with both present apart, the
    # tensor is [batch, seq, ...] and the width is not folded tokens.
    apart = b in dims and s in dims and (b != s or dims.count(b) > 1)
    if b > 1 and s > 1 and b * s in dims and not apart:
        dims.remove(b * s)
        eb, es = 1, 1
    elif b > 1 and b in dims and b != s:
        dims.remove(b)
        eb = 1
    elif b > 1 and dims and dims[0] % b == 0 and dims[0] != s:
        dims.pop(0)
        eb = 1
    if s > 1:
        es += sum(1 for d in dims if d == s)
    return min(eb, 2), min(es, 3)


def _size(entries: dict[Key, tuple[int, int, int]], exclude: set[Key] | None = None) -> Size:
    by_exp: dict[tuple[int, int], int] = defaultdict(int)
    for key, (nbytes, eb, es) in entries.items():
        if exclude is None or key not in exclude:
            by_exp[(eb, es)] += nbytes
    return Size(tuple(Term(n, eb, es) for (eb, es), n in sorted(by_exp.items()) if n))


class _Timed(TorchDispatchMode):
    """Times every op of a forward, and records per op policy (``policies``: a mode's decider of what it keeps,
    as :mod:`rematd.client.blocks.selective` defines them) the outputs it would keep and the time spent outside
    them: what that mode keeps, and what its recomputation runs again."""

    def __init__(self, cuda: bool, policies: dict[Mode, Decide], parts: list[Mode]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cuda = cuda
        self.policies = policies
        self.kept: dict[Mode, list[torch.Tensor]] = {m: [] for m in policies}
        self.other_seconds: dict[Mode, float] = dict.fromkeys(policies, 0.0)
        self.total_seconds = 0.0
        """The forward's ops' own time: what recomputing the block runs again."""
        self.parts = parts
        """The block's parts running now (the profiler's list, innermost last)."""
        self.part_seconds: dict[Mode, float] = {}
        """Per part, its ops' own time: what recomputing the part runs again."""
        self.ops = 0
        """Ops the forward ran: what a policy's dispatch pays for, in its forward and in its recomputation."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        spent = time.perf_counter() - start
        self.total_seconds += spent
        self.ops += 1
        for part in self.parts:
            self.part_seconds[part] = self.part_seconds.get(part, 0.0) + spent
        for mode, decide in self.policies.items():
            if decide(func, args, kwargs):
                self.kept[mode].extend(outputs_of(out))
            else:
                self.other_seconds[mode] += spent
        return out

    def clear(self) -> None:
        """Let go of the outputs collected (a failed step's graph, or a measured one)."""
        for kept in self.kept.values():
            kept.clear()

    def share(self, mode: Mode) -> float:
        """The fraction of the forward's op time ``mode``'s recomputation runs again."""
        return self.other_seconds[mode] / self.total_seconds if self.total_seconds else 1.0


@functools.cache
def dispatch_seconds() -> float:
    """Host seconds a Python dispatch mode adds to one op (a selective policy pays it on every op of the block,
    in its forward and again in its recomputation), measured once per process on small tensors."""
    x = torch.ones(16)

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            torch.add(x, x)
        return time.perf_counter() - start

    run(50)
    plain = min(run(200) for _ in range(3))
    with Empty():  # type: ignore[no-untyped-call]
        run(50)
        hooked = min(run(200) for _ in range(3))
    return max(0.0, hooked - plain) / 200


@dataclass(slots=True)
class BlockMeasure:
    """One block's profile, measured on a forward without checkpointing."""

    saved_bytes: int = 0
    input_bytes: int = 0
    forward_seconds: float = 0.0
    modes: tuple[ModeCost, ...] = ()
    kept_needed: dict[Mode, tuple[bool, ...]] = field(default_factory=dict)
    """Per op policy, of the outputs it keeps in the order the forward makes them, whether backward needs each
    (an op saves it): the others are let go once the block's backward begins."""
    routed_rows: int = 0
    """The token rows the block's expert bank received in this forward (0: the block has no experts)."""
    routed: dict[Mode, tuple[int, int]] = field(default_factory=dict)
    """Per mode, the bytes it keeps and holds in its recomputation (kept, transient) that have a row per token
    the experts received: what grows with the rows the router sends this rank's experts."""


def alike_seconds(measures: list[BlockMeasure | None]) -> list[BlockMeasure | None]:
    """``measures`` with the seconds of blocks alike (the same bytes saved and kept in every mode: the same
    layer, as a transformer repeats it) made their median, mode by mode. The profiling step times each block
    once, cold: the first block of a CPU run measured 1.5-2x its twins, and a block preempted by another
    process ten times; a per-block price that far off would decide which blocks recompute. The steps then
    scale the median as they scale any price."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, m in enumerate(measures):
        if m is not None:
            shape = tuple((c.mode, c.kept, c.transient, c.released) for c in m.modes)
            groups.setdefault((m.saved_bytes, m.input_bytes, shape), []).append(i)
    out = list(measures)
    for members in groups.values():
        if len(members) < 2:
            continue
        alike = [m for i in members if (m := measures[i]) is not None]
        # Alike, they list the same modes in the same order.
        columns = list(zip(*(m.modes for m in alike), strict=True))
        # The timed seconds and the checkpoint's own work apart: a price is their sum, its share the second.
        fixed = [statistics.median(c.fixed_seconds for c in column) for column in columns]
        timed = [statistics.median(c.extra_seconds - c.fixed_seconds for c in column) for column in columns]
        forward = statistics.median(m.forward_seconds for m in alike)
        for i, m in zip(members, alike, strict=True):
            modes = tuple(
                dataclasses.replace(c, extra_seconds=t + f, fixed_seconds=f)
                for c, t, f in zip(m.modes, timed, fixed, strict=True)
            )
            out[i] = dataclasses.replace(m, forward_seconds=forward, modes=modes)
    return out


class Profiler:
    """Measures one block forward; ``record`` sees each tensor it saves for backward."""

    def __init__(
        self,
        shape: Shape,
        excluded: frozenset[Key],
        cuda: bool,
        gathered: frozenset[int] = frozenset(),
        probe: CompressProbe | None = None,
        policies: dict[Mode, Decide] | None = None,
        compiled: frozenset[Mode] = frozenset(),
    ) -> None:
        self.shape = shape
        self.probe = probe
        """Prices the compress mode on what the block saved (None: the mode is not offered)."""
        self.excluded = excluded
        self.gathered = gathered
        """Storages of the parameters as the block runs (those a sharded set-up gathered): weights, not activations."""
        self.cuda = cuda
        self.saved: dict[Key, tuple[int, int, int]] = {}
        self._parts: list[Mode] = []
        """The parts running now, innermost last."""
        self.timer = _Timed(cuda, policies or {}, self._parts)
        self._where: dict[Key, set[Mode | None]] = {}
        """Per storage saved, the parts it was saved in (None: outside any part)."""
        self._part_inputs: dict[Mode, dict[Key, tuple[int, int, int]]] = {}
        self._part_seconds: dict[Mode, float] = {}
        self._clock = 0
        """Counts the saves and the parts' starts and ends, in the order they happen."""
        self._first: dict[Key, int] = {}
        """Per storage saved, when it was first saved."""
        self._ended: dict[Mode, int] = {}
        """Per part, when its forward last ended."""
        self._rows = 0
        """The rows the block's expert bank received, once it has run (:meth:`enter_bank`)."""
        self._routed: set[Key] = set()
        """Storages with a row per token the experts received: saved in the bank, or after it with its rows."""
        self._routed_of: dict[Mode, tuple[int, int]] = {}
        self.compiled = compiled
        """Modes whose checkpoint runs inside a compiled graph, whose hooks are not Python's: no region cost."""
        self._packs: dict[Mode | None, int] = defaultdict(int)
        """Tensors saved for backward, in all (None) and per part: what a checkpoint of it hooks."""

    def count_saved(self) -> None:
        """The forward saved a tensor for backward (a weight too, which :meth:`record` is not shown): one more
        that a checkpoint of the block, and of each part running, hooks."""
        self._packs[None] += 1
        for part in self._parts:
            self._packs[part] += 1

    def record(self, t: torch.Tensor) -> None:
        if self.gathered and storage_id(t) in self.gathered:
            return
        key = storage_key(t)
        if key in self.excluded:
            return
        if self.probe is not None:
            self.probe.record(key, t)
        rows = self._rows
        # Any dimension: a bank's batched matmuls save its rows behind a leading one of experts (or of one). A
        # size that only matches the rows by chance is taken to grow with them: the guard then projects more.
        routed = rows > 0 and rows in t.shape
        if key not in self.saved:
            # Rows of routed tokens scale with the tokens, whatever the batch and length they came from.
            self.saved[key] = (storage_bytes(t), 1, 1) if routed else (storage_bytes(t), *exponents(t, self.shape))
            self._clock += 1
            self._first[key] = self._clock
        self._where.setdefault(key, set()).add(self._parts[-1] if self._parts else None)
        if routed:
            self._routed.add(key)

    def enter_bank(self, rows: int) -> None:
        """The block's expert bank starts its forward on ``rows`` token rows: from now on a saved tensor with a
        row per token it received is routed (the bank's own, and the combine's after it)."""
        self._rows = self._rows or rows

    def _note_routed(self, mode: Mode, kept: Any, transient: Any) -> None:
        """The routed bytes of what ``mode`` keeps and holds while it recomputes (key collections)."""
        routed = self._routed
        if routed:
            self._routed_of[mode] = (
                sum(self.saved[k][0] for k in kept if k in routed),
                sum(self.saved[k][0] for k in transient if k in routed),
            )

    def enter_part(self, mode: Mode, inputs: list[torch.Tensor]) -> None:
        """A part of the block (:mod:`rematd.client.blocks.parts`) starts its forward on ``inputs``."""
        self._parts.append(mode)
        self._part_inputs.setdefault(mode, {}).update(self._entries(inputs))

    def leave_part(self, mode: Mode, seconds: float) -> None:
        """It ended, ``seconds`` after it started."""
        if self._parts and self._parts[-1] == mode:
            self._parts.pop()
        self._part_seconds[mode] = self._part_seconds.get(mode, 0.0) + seconds
        self._clock += 1
        self._ended[mode] = self._clock

    def _entries(self, tensors: list[torch.Tensor]) -> dict[Key, tuple[int, int, int]]:
        saved = self.saved
        return {
            key: saved.get(key) or (storage_bytes(t), *exponents(t, self.shape))
            for t in tensors
            if (key := storage_key(t)) not in self.excluded and not (self.gathered and storage_id(t) in self.gathered)
        }

    def result(
        self, inputs: list[torch.Tensor], seconds: float, offer: frozenset[Mode], host_link: HostLink | None
    ) -> BlockMeasure:
        """The block's profile; ``seconds``: its forward's wall time, the price of recomputing it where the
        ops were not timed one by one. Where they were, their own time is: the wall time also holds this
        profile's bookkeeping (a Python call per op and per tensor saved), a third of it or more on a CPU,
        which no mode pays, and which the op policies' and parts' prices (their ops' time) do not hold."""
        if self.timer.ops:
            seconds = self.timer.total_seconds
        inp = self._entries(inputs)
        store = _size(self.saved)
        inp_size = _size(inp)
        modes = [ModeCost(mode=Mode.STORE, kept=store)]
        self._note_routed(Mode.STORE, self.saved, ())
        for mode in self.timer.policies:
            if mode in offer:
                modes.append(self._policy_cost(mode, inp))
        for mode in sorted(self._part_seconds):
            if mode in offer:
                modes.append(self._part_cost(mode))
        if Mode.RECOMPUTE in offer:
            modes.append(ModeCost(mode=Mode.RECOMPUTE, kept=inp_size, transient=store, extra_seconds=seconds))
            self._note_routed(Mode.RECOMPUTE, inp, self.saved)
        if self.probe is not None and Mode.COMPRESS in offer:
            modes.append(self._compress_cost())
        if Mode.OFFLOAD in offer and host_link is not None and host_link.bandwidth > 0:
            # While its backward runs, the blocks fetched ahead come back too (their copies overlap it).
            held = 1 + host_link.ahead
            modes.append(
                ModeCost(
                    mode=Mode.OFFLOAD,
                    kept=Size(),
                    transient=Size(tuple(Term(held * t.bytes, t.batch_exp, t.seq_exp) for t in store.terms)),
                    # Out and back, none of it overlapped: the steps that run it measure what hid.
                    extra_seconds=2 * store.bytes / host_link.bandwidth,
                )
            )
            self._note_routed(Mode.OFFLOAD, (), [*self.saved] * held)
        return BlockMeasure(
            saved_bytes=store.bytes,
            input_bytes=inp_size.bytes,
            forward_seconds=seconds,
            modes=tuple(self._with_region(m) for m in modes),
            kept_needed=self._kept_needed(),
            routed_rows=self._rows if self._routed else 0,
            routed=dict(self._routed_of),
        )

    def _with_region(self, cost: ModeCost) -> ModeCost:
        """``cost`` with the checkpoint's own work around its region (:mod:`~rematd.client.blocks.region_cost`)
        on the tensors the region saves, where it checkpoints one, on the CPU. On a GPU the host's work overlaps
        the device's kernels, which the steps' timing of the whole step shows better than a host's figure."""
        if self.cuda or cost.mode in self.compiled:
            return cost
        if cost.mode in WHOLE_REGION:
            saved = self._packs[None]
        elif cost.mode in self._part_seconds:
            saved = self._packs[cost.mode]
        else:
            return cost
        # An op policy's forward is timed against a stored one's, its checkpoint's hooks there included: the
        # steps see that half, and its price holds the backward's alone.
        fixed = region_cost().of(saved, backward_only=cost.mode in self.timer.policies)
        return dataclasses.replace(cost, extra_seconds=cost.extra_seconds + fixed, fixed_seconds=fixed)

    def _policy_cost(self, mode: Mode, inp: dict[Key, tuple[int, int, int]]) -> ModeCost:
        """An op policy's mode: it keeps the block's input and the outputs its policy keeps; its recomputation
        runs the other ops again, and its dispatch costs every op twice (forward and recomputation). A kept
        output that no op saves for backward is let go once the recomputation has used it: by the time the
        block rematerialises it holds what storing would, and its input."""
        outputs = self._entries(self.timer.kept[mode])
        kept = {**inp, **outputs}
        self._note_routed(mode, kept, [k for k in self.saved if k not in kept])
        return ModeCost(
            mode=mode,
            kept=_size(kept),
            transient=_size(self.saved, exclude=set(kept)),
            extra_seconds=self.timer.other_seconds[mode] + 2 * self.timer.ops * dispatch_seconds(),
            released=_size({k: v for k, v in outputs.items() if k not in self.saved and k not in inp}),
        )

    def _kept_needed(self) -> dict[Mode, tuple[bool, ...]]:
        return {mode: tuple(storage_key(t) in self.saved for t in kept) for mode, kept in self.timer.kept.items()}

    def _part_cost(self, mode: Mode) -> ModeCost:
        """A part's mode: the block keeps what storing keeps but what only the part saved, and the part's input;
        the part's activations come back in backward, by running its forward again."""
        inside = {k for k, where in self._where.items() if where == {mode}}
        kept = {k: v for k, v in self.saved.items() if k not in inside}
        kept.update(self._part_inputs.get(mode, {}))
        # What was first saved after the part ran is freed by the backward of what saved it, which runs first.
        ended = self._ended.get(mode, self._clock)
        released = {k: v for k, v in kept.items() if self._first.get(k, 0) > ended}
        self._note_routed(mode, kept, inside)
        return ModeCost(
            mode=mode,
            kept=_size(kept),
            transient=_size({k: self.saved[k] for k in inside}),
            # Its ops' own time, as the block's price is; its wall time where no op of it was timed.
            extra_seconds=self.timer.part_seconds.get(mode) or self._part_seconds[mode],
            released=_size(released),
        )

    def _compress_cost(self) -> ModeCost:
        """Compress's kept bytes and seconds, measured on this forward's saved tensors; each storage's
        compressed bytes scale as the storage does."""
        assert self.probe is not None
        price = self.probe.measure({k: v[0] for k, v in self.saved.items()})

        def sized(nbytes: dict[Key, int]) -> Size:
            return _size({k: (n, *self.saved[k][1:]) for k, n in nbytes.items() if k in self.saved})

        routed = self._routed
        if routed:
            self._routed_of[Mode.COMPRESS] = (
                sum(n for k, n in price.kept.items() if k in routed),
                sum(n for k, n in price.transient.items() if k in routed),
            )

        return ModeCost(
            mode=Mode.COMPRESS, kept=sized(price.kept), transient=sized(price.transient), extra_seconds=price.seconds
        )


@dataclass(frozen=True, slots=True)
class HostLink:
    """The link offload copies over: its measured bandwidth, and how many blocks come back ahead of their
    backward (each of them held on the device while the one before them runs its backward)."""

    bandwidth: float
    """Bytes per second of a device-to-host copy into a reused pinned buffer."""
    ahead: int = 1
    """Offloaded blocks fetched back with the one whose backward starts (``OffloadConfig.prefetch_blocks``)."""


def host_bandwidth(device: torch.device, nbytes: int = 64 * 2**20) -> float | None:
    """Bytes per second of a device-to-host copy into pinned memory allocated once (as offload's pool reuses
    its buffers); None off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - start)
