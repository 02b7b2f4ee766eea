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

import math
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from rematd.client.accounting import SavedTensorAccounting, storage_id, storage_key
from rematd.client.recompute_timing import RecomputeTimer
from rematd.planner import Mode

FORMATS = ("int8", "fp8", "bf16")
"""What a compressed element is: an 8-bit integer or an FP8 (e4m3) number with a scale per block of
elements, or a plain cast to bfloat16."""

_QMAX = {"int8": 127.0, "fp8": 448.0}
"""The largest magnitude of each scaled format: a block's largest element maps onto it."""
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

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"compress.format must be one of {', '.join(map(repr, FORMATS))}; got {self.format!r}")
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


def quantize(flat: torch.Tensor, config: CompressConfig) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A 1-D tensor in the config's format: (values, one float32 scale per block); None to keep it as it is."""
    if config.format == "bf16":
        return flat.to(torch.bfloat16), None
    pad = -flat.numel() % config.block_size
    x = (F.pad(flat, (0, pad)) if pad else flat).view(-1, config.block_size)
    qmax = _QMAX[config.format]
    amax = x.abs().amax(dim=1, keepdim=True).float()
    if not x.is_cuda and not math.isfinite(float(amax.max())):
        return None
    y = x.float() * (qmax / amax.clamp_min(torch.finfo(torch.float32).tiny))
    # int8: |y| <= 127 up to rounding, which round() absorbs; fp8: a hair over 448 must not overflow.
    q = y.round_().to(torch.int8) if config.format == "int8" else y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
    return q, amax.div_(qmax)


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D tensor :func:`quantize` was given, to within its format's error."""
    if scale is None:
        return q.to(dtype)
    return q.to(torch.float32).mul_(scale).view(-1)[:numel].to(dtype)


@dataclass(slots=True, eq=False)
class Packed:
    """One saved tensor as a compressed block keeps it."""

    values: torch.Tensor
    scale: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    order: tuple[int, ...] | None
    """The permutation that made it contiguous (None: it was copied contiguous)."""
    held: tuple[Any, ...] = ()
    """The accounting's holders of the compressed bytes (released with this)."""
    restored: weakref.ref[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        scale = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.values.numel() * self.values.element_size() + scale

    def restore(self) -> torch.Tensor:
        """The tensor in its dtype, shape and (for a permuted one) strides; the same one while it lives."""
        alive = self.restored() if self.restored is not None else None
        if alive is not None:
            return alive  # saved twice (two ops' inputs): one restored copy serves both
        numel = self.shape.numel()
        flat = dequantize(self.values, self.scale, numel, self.dtype)
        if self.order is None:
            out = flat.view(self.shape)
        else:
            inverse = tuple(sorted(range(len(self.order)), key=lambda d: self.order[d]))  # type: ignore[index]
            out = flat.view([self.shape[d] for d in self.order]).permute(inverse)
        self.restored = weakref.ref(out)
        return out


def pack_tensor(t: torch.Tensor, config: CompressConfig) -> Packed | None:
    """``t`` compressed; None when it holds what the format cannot represent (CPU only)."""
    order = _dense_order(t)
    flat = t.permute(order).reshape(-1) if order is not None else t.reshape(-1)
    packed = quantize(flat, config)
    if packed is None:
        return None
    return Packed(values=packed[0], scale=packed[1], shape=t.shape, dtype=t.dtype, order=order)


def _geometry(t: torch.Tensor) -> tuple[object, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


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

    @contextmanager
    def block(self, constants: frozenset[int] = frozenset(), weights: frozenset[int] = frozenset()) -> Iterator[None]:
        """Around one block's forward. ``constants``: storages of its inputs that need no gradient;
        ``weights``: storages of its parameters as it runs them (FSDP's gathered ones)."""
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
            key = _geometry(t)
            hit = seen.get(key)
            if hit is not None and hit[0]() is not None:
                return hit[1]  # the same tensor saved again: compressed once
            packed = pack_tensor(t, self.config)
            if packed is None:
                return keep(t)
            if acct is not None:
                packed.held = tuple(acct.pack(x) for x in (packed.values, packed.scale) if x is not None)
            seen[key] = (weakref.ref(t), packed)
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, Packed):
            return SavedTensorAccounting.unpack(x)
        timer = self.timer
        if timer is None:
            return x.restore()
        if x.values.is_cuda:
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
    """Measures at the profile what a block would keep compressed: it compresses each tensor the block
    saved, as the mode would (once per view), times that and the restore, and counts the bytes."""

    def __init__(self, config: CompressConfig, constants: frozenset[int], cuda: bool) -> None:
        self.config = config
        self.constants = constants
        self.cuda = cuda
        self._views: dict[tuple[str, int], dict[tuple[object, ...], torch.Tensor | None]] = {}

    def record(self, key: tuple[str, int], t: torch.Tensor) -> None:
        """One saved tensor (not a parameter's) on the storage ``key``."""
        views = self._views.setdefault(key, {})
        ok = compressible(t, self.config, self.constants)
        views[_geometry(t) if ok else ("kept",)] = t if ok else None

    def measure(self, stored: dict[tuple[str, int], int]) -> CompressPrice:
        """The price, from ``stored``: each storage's bytes when stored."""
        kept: dict[tuple[str, int], int] = {}
        restored: list[tuple[int, tuple[str, int]]] = []
        seconds = 0.0
        for key, views in self._views.items():
            full = stored.get(key, 0)
            kept[key] = full if ("kept",) in views else 0
            for t in views.values():
                if t is None:
                    continue
                nbytes, spent = self._compress(t)
                seconds += spent
                kept[key] += full if nbytes is None else nbytes
                if nbytes is not None:
                    restored.append((t.numel() * t.element_size(), key))
        # Backward restores a node's saved tensors together: a matmul's two inputs at most, for long.
        largest = sorted(restored, reverse=True)[:2]
        transient: dict[tuple[str, int], int] = {}
        for nbytes, key in largest:
            transient[key] = transient.get(key, 0) + nbytes
        self._views.clear()
        return CompressPrice(kept=kept, transient=transient, seconds=seconds)

    def _compress(self, t: torch.Tensor) -> tuple[int | None, float]:
        sync: Callable[[], None] = torch.cuda.synchronize if self.cuda else (lambda: None)
        sync()
        began = time.perf_counter()
        packed = pack_tensor(t.detach(), self.config)
        if packed is not None:
            packed.restore()
        sync()
        return (packed.nbytes if packed is not None else None), time.perf_counter() - began
