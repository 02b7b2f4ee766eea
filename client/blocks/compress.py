"""Compress: a block keeps its saved activations in 8 bits (or bf16) until its backward needs them.

Between storing (every activation kept as it is) and recomputing (the block's
forward again in backward) sits keeping them smaller: each floating-point
tensor the block saves for backward is quantized as it is saved, with one
scale per :attr:`CompressConfig.block_size` contiguous elements, and restored
to its dtype and shape when backward unpacks it. A scale per block of elements,
not per tensor, keeps an outlier from flattening every other value: only the
elements of its own block share its scale.

Nothing runs twice, so dropout and every random draw stay exactly as when
storing; what changes is the values backward reads, so gradients are close
to, not equal to, those of storing (the mode is lossy: ``docs/compress.md``).

Kept as they are: integer and boolean tensors (indices, masks), tensors
already as small as the format (an 8-bit tensor, a bf16 one under ``"bf16"``),
parameters and buffers and whatever aliases them, constants handed to the
block that need no gradient (masks, rotary tables: every block would keep a
copy of the one tensor the caller holds anyway), tensors under
:attr:`CompressConfig.min_bytes`, and on the CPU any tensor holding an
infinity or a NaN (its scale could not represent it; checking costs a device
synchronisation on CUDA, where such a block of elements restores as NaN).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rematd.client.blocks.mode_timing import RecomputeTimer
from rematd.client.blocks.quantize import dequantize, quantize
from rematd.client.memory.accounting import SavedTensorAccounting, storage_id, storage_key
from rematd.planner import Mode

log = logging.getLogger("rematd.client")

FORMATS = ("int8", "fp8", "bf16")
"""What a compressed element is: an 8-bit integer or an FP8 (e4m3) number with a scale per block of
elements, or a plain cast to bfloat16."""

_STORED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}


@dataclass(kw_only=True, slots=True)
class CompressConfig:
    """How blocks in the ``compress`` mode keep their saved tensors (``attach(..., compress=...)``)."""

    format: str = "int8"
    """``"int8"`` (default: a uniform grid per block of elements, the smallest error of the 8-bit
    formats on activations), ``"fp8"`` (``float8_e4m3fn``: relative precision, 3 mantissa bits) or
    ``"bf16"`` (a plain cast, no scales: half the bytes of float32, nothing saved on 16-bit tensors)."""
    block_size: int = 128
    """Contiguous elements sharing one float32 scale (int8 and fp8). 128 keeps the scales' overhead at
    1/32 of the 8-bit payload and, with widths that are multiples of 128, a block inside one row: an
    outlier token shares its scale with 127 of its own features, not with other tokens."""
    min_bytes: int = 16 * 1024
    """Tensors smaller than this are kept as they are: their few bytes are not worth the kernels."""
    compiled_kernels: bool = True
    """Quantize and restore large tensors with kernels compiled by ``torch.compile`` (one fused pass
    each way, compiled once per process; see ``rematd.client.blocks.quantize``). False: plain tensor operations
    only, several passes each (no compiler needed, no compiling time)."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"compress.format must be one of {', '.join(map(repr, FORMATS))}; got {self.format!r}")
        if not isinstance(self.compiled_kernels, bool):
            raise ValueError(f"compress.compiled_kernels must be True or False; got {self.compiled_kernels!r}")
        for name, low in (("block_size", 1), ("min_bytes", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"compress.{name} must be an integer >= {low}; got {value!r}")
        if self.format != "bf16" and self.block_size % 8:
            raise ValueError(f"compress.block_size must be a multiple of 8; got {self.block_size!r}")

    @property
    def stored_dtype(self) -> torch.dtype:
        return _STORED[self.format]


def check_compress(value: object) -> CompressConfig:
    """``attach``'s ``compress``: a :class:`CompressConfig`, a format's name, or None (the defaults)."""
    if value is None:
        return CompressConfig()
    if isinstance(value, str):
        return CompressConfig(format=value)
    if isinstance(value, CompressConfig):
        return value
    raise TypeError(f"compress must be a CompressConfig, a format ({', '.join(FORMATS)}) or None, got {value!r}")


def compressible(t: torch.Tensor, config: CompressConfig, constants: frozenset[int] = frozenset()) -> bool:
    """Whether ``t`` is worth compressing by its own properties (a parameter's storage is checked apart)."""
    if not t.is_floating_point() or t.layout != torch.strided or t.is_quantized:
        return False
    if t.element_size() <= config.stored_dtype.itemsize or t.numel() * t.element_size() < config.min_bytes:
        return False
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return False  # a tensor subclass (a distributed tensor): its local part is not ours to rewrite
    base = t._base if t._base is not None else t
    if base.is_leaf and base.requires_grad:
        return False  # a parameter, or a view of one
    return t.requires_grad or storage_id(t) not in constants


def _dense_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation under which ``t`` is contiguous (a transposed tensor), None when there is none."""
    strides = t.stride()
    order = tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return order if t.permute(order).is_contiguous() else None


@dataclass(slots=True, eq=False)
class Packed:
    """A run of a storage's elements, compressed; the saved tensors that view it restore from it."""

    values: torch.Tensor
    scale: torch.Tensor | None
    numel: int
    dtype: torch.dtype
    compiled: bool = True
    """Whether restoring may use the compiled kernel."""
    held: tuple[Any, ...] = ()
    """The accounting's holders of the compressed bytes (released with this)."""
    restored: weakref.ref[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        scale = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.values.numel() * self.values.element_size() + scale

    def flat(self) -> torch.Tensor:
        """The run restored, 1-D; the same tensor while it lives (two ops' inputs share one copy)."""
        alive = self.restored() if self.restored is not None else None
        if alive is not None:
            return alive
        out = dequantize(self.values, self.scale, self.numel, self.dtype, compiled=self.compiled)
        self.restored = weakref.ref(out)
        return out


@dataclass(slots=True, eq=False)
class Saved:
    """One saved tensor: a view of a packed run."""

    packed: Packed
    shape: torch.Size
    order: tuple[int, ...] | None
    """The permutation that made it contiguous (None: it was contiguous, or copied contiguous)."""

    def restore(self) -> torch.Tensor:
        """The tensor in its dtype, shape and (for a permuted one) strides."""
        flat = self.packed.flat()
        if self.order is None:
            return flat.view(self.shape)
        order = self.order
        inverse = tuple(sorted(range(len(order)), key=lambda d: order[d]))
        return flat.view([self.shape[d] for d in order]).permute(inverse)


def region(t: torch.Tensor) -> tuple[tuple[object, ...], tuple[int, ...] | None]:
    """What ``t`` compresses as: the run of its storage it covers (a dense tensor, in any order: views of
    one run, a softmax's output and the batched matmul's view of it, share one compressed copy) or, for
    a tensor with gaps, its own geometry; and the permutation that makes it contiguous."""
    where = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t.device)
    if t.is_contiguous():
        return (*where, t.numel()), None
    order = _dense_order(t)
    return ((*where, t.numel()) if order is not None else (*where, tuple(t.shape), t.stride())), order


def pack_run(t: torch.Tensor, order: tuple[int, ...] | None, config: CompressConfig) -> Packed | None:
    """The run ``t`` covers, compressed; None when it holds what the format cannot represent (CPU only)."""
    flat = t.permute(order).reshape(-1) if order is not None else t.reshape(-1)
    compiled = config.compiled_kernels
    quantized = quantize(flat, config.format, config.block_size, compiled=compiled)
    if quantized is None:
        return None
    return Packed(values=quantized[0], scale=quantized[1], numel=flat.numel(), dtype=t.dtype, compiled=compiled)


def pack_tensor(t: torch.Tensor, config: CompressConfig) -> Saved | None:
    """``t`` compressed on its own (no sharing with other views)."""
    order = region(t)[1]
    packed = pack_run(t, order, config)
    return Saved(packed, t.shape, order) if packed is not None else None


class Compressor:
    """Saved-tensor hooks that keep blocks' activations compressed between forward and backward."""

    def __init__(
        self,
        config: CompressConfig,
        accounting: SavedTensorAccounting | None = None,
        timer: RecomputeTimer | None = None,
    ) -> None:
        self.config = config
        self.accounting = accounting
        self.timer = timer
        self.failed = False
        """Whether compressing some tensor failed (logged once; that tensor was kept as it is)."""

    @contextmanager
    def block(self, constants: frozenset[int] = frozenset(), weights: frozenset[int] = frozenset()) -> Iterator[None]:
        """Around one block's forward. ``constants``: storages of its inputs that need no gradient;
        ``weights``: storages of its parameters as it runs them (those a sharded set-up gathered)."""
        # Runs compressed in this forward, by region(): while the first view lives, the run is the same memory.
        seen: dict[tuple[object, ...], tuple[weakref.ref[torch.Tensor], Packed]] = {}
        acct = self.accounting if self.accounting is not None and self.accounting.active else None
        excluded = self.accounting.excluded if self.accounting is not None else frozenset()

        def keep(t: torch.Tensor) -> Any:
            return acct.pack(t) if acct is not None else t

        def pack(t: torch.Tensor) -> Any:
            if not compressible(t, self.config, constants) or storage_key(t) in excluded:
                return keep(t)
            if weights and storage_id(t) in weights:
                return keep(t)
            key, order = region(t)
            hit = seen.get(key)
            if hit is not None and hit[0]() is not None:
                return Saved(hit[1], t.shape, order)  # another view of a run already compressed
            packed = self._pack_run(t, order)
            if packed is None:
                return keep(t)
            if acct is not None:
                packed.held = tuple(acct.pack(x) for x in (packed.values, packed.scale) if x is not None)
            seen[key] = (weakref.ref(t), packed)
            return Saved(packed, t.shape, order)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _pack_run(self, t: torch.Tensor, order: tuple[int, ...] | None) -> Packed | None:
        """:func:`pack_run`, or None (the tensor kept as it is) when compressing fails: the step goes on."""
        try:
            return pack_run(t, order, self.config)
        except Exception as err:
            if not self.failed:
                self.failed = True
                log.warning(
                    "rematd: compressing a saved tensor failed (%s: %s); such tensors are kept as they are",
                    type(err).__name__,
                    str(err)[:300],
                )
            return None

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, Saved):
            return SavedTensorAccounting.unpack(x)
        timer = self.timer
        if timer is None:
            return x.restore()
        if x.packed.values.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = x.restore()
            end.record()
            timer.add_events(Mode.COMPRESS, start, end)
            return out
        began = time.perf_counter()
        out = x.restore()
        timer.add_seconds(Mode.COMPRESS, time.perf_counter() - began)
        return out


def constant_storages(inputs: list[torch.Tensor]) -> frozenset[int]:
    """Storages of a block's inputs that need no gradient: constants the caller holds for every block."""
    return frozenset(i for t in inputs if not t.requires_grad and (i := storage_id(t)) is not None)


@dataclass(slots=True)
class CompressPrice:
    """What compressing a profiled block costs: kept bytes per saved storage, the largest restored
    tensors, and the seconds of compressing and restoring them all."""

    kept: dict[tuple[str, int], int]
    transient: dict[tuple[str, int], int]
    seconds: float


class CompressProbe:
    """Measures at the profile what a block would keep compressed: it compresses each run of memory the
    block saved, as the mode would (once per :func:`region`), times that and the restore, and counts the
    bytes."""

    def __init__(self, config: CompressConfig, constants: frozenset[int], cuda: bool) -> None:
        self.config = config
        self.constants = constants
        self.cuda = cuda
        self._runs: dict[tuple[str, int], dict[tuple[object, ...], torch.Tensor | None]] = {}
        """Per storage, the runs saved on it: a tensor to compress, or None for one kept as it is."""

    def record(self, key: tuple[str, int], t: torch.Tensor) -> None:
        """One saved tensor (not a parameter's) on the storage ``key``."""
        runs = self._runs.setdefault(key, {})
        if compressible(t, self.config, self.constants):
            runs.setdefault(region(t)[0], t)
        else:
            runs[("kept",)] = None

    def measure(self, stored: dict[tuple[str, int], int]) -> CompressPrice:
        """The price, from ``stored``: each storage's bytes when stored."""
        kept: dict[tuple[str, int], int] = {}
        restored: list[tuple[int, tuple[str, int]]] = []
        seconds = 0.0
        for key, runs in self._runs.items():
            compressed, whole = 0, ("kept",) in runs
            for t in (t for t in runs.values() if t is not None):
                nbytes, spent = self._compress(t)
                seconds += spent
                whole = whole or nbytes is None
                compressed += nbytes or 0
                restored.append((t.numel() * t.element_size(), key))
            # A storage some saved tensor keeps as it is stays whole, beside any compressed runs of it.
            kept[key] = compressed + (stored.get(key, 0) if whole else 0)
        self._runs.clear()
        return CompressPrice(kept=kept, transient=_two_largest(restored), seconds=seconds)

    def _compress(self, t: torch.Tensor) -> tuple[int | None, float]:
        sync: Callable[[], None] = torch.cuda.synchronize if self.cuda else (lambda: None)
        sync()
        began = time.perf_counter()
        saved = pack_tensor(t.detach(), self.config)
        if saved is not None:
            saved.restore()
        sync()
        return (saved.packed.nbytes if saved is not None else None), time.perf_counter() - began


def _two_largest(restored: list[tuple[int, tuple[str, int]]]) -> dict[tuple[str, int], int]:
    """Backward restores one node's saved tensors together (a matmul's two inputs): the transient bytes."""
    transient: dict[tuple[str, int], int] = {}
    for nbytes, key in sorted(restored, reverse=True)[:2]:
        transient[key] = transient.get(key, 0) + nbytes
    return transient
