"""The compress mode's kernels: blocks of elements to 8 bits with a scale each, and back.

Written as plain tensor code, each direction is several passes over the tensor
(an absolute value, a reduction, a division, a rounding, a cast), each with its
own allocation and dispatch: on the CPU, quantizing took four times a copy of
the tensor. Compiled, each direction is one fused loop: the tensor is read
twice (its blocks' largest magnitudes, then the scaled values) and the 8-bit
values written once. So the kernels are compiled with ``torch.compile`` (shapes
dynamic: one compilation per format and dtype serves every size) the first time
they run, and where compiling fails (no C++ compiler for the CPU, no Triton for
CUDA) the same code runs uncompiled: slower, never wrong.
``CompressConfig(compiled_kernels=False)`` skips compiling.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

log = logging.getLogger("rematd.client")

QMAX = {"int8": 127.0, "fp8": 448.0}
"""The largest magnitude of each scaled format: a block's largest element maps onto it."""
_TINY = torch.finfo(torch.float32).tiny


def _int8(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of ``flat`` on a uniform grid of 255 steps spanning each block's largest magnitude. In place
    where it can be: uncompiled, every pass allocates and dispatches; compiled, the same code is one loop."""
    x = flat.view(-1, block)
    scale = x.abs().amax(dim=1, keepdim=True).float().mul_(1.0 / QMAX["int8"])
    # |x / scale| <= 127 up to rounding, which round() absorbs.
    return torch.div(x, scale.clamp_min(_TINY)).round_().to(torch.int8), scale


def _fp8(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of ``flat`` as e4m3 numbers, each block's largest magnitude mapped onto 448."""
    x = flat.view(-1, block)
    qmax = QMAX["fp8"]
    scale = x.abs().amax(dim=1, keepdim=True).float().mul_(1.0 / qmax)
    # A hair over 448 after the division must not overflow to NaN.
    return torch.div(x, scale.clamp_min(_TINY)).clamp_(-qmax, qmax).to(torch.float8_e4m3fn), scale


def _restore(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.to(torch.float32).mul_(scale).to(dtype)


class Kernel:
    """One kernel: compiled on first use where that works, for tensors of at least ``compiled_from``
    elements; run as it is below that, and everywhere once compiling failed."""

    compiling = True
    """Whether compiling works here (False, for every kernel, once compiling one has failed)."""
    _lock = threading.Lock()

    def __init__(self, plain: Callable[..., Any], compiled_from: int) -> None:
        self.plain, self.compiled_from = plain, compiled_from
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, x: torch.Tensor, *args: Any, compiled: bool = True) -> Any:
        if not (compiled and Kernel.compiling) or x.numel() < self.compiled_from:
            return self.plain(x, *args)
        if self._compiled is None:
            with Kernel._lock:
                if self._compiled is None:
                    self._compiled = torch.compile(self.plain, dynamic=True, fullgraph=True)
        try:
            return self._compiled(x, *args)
        except Exception as err:  # a missing compiler, a backend that cannot lower this: run it plainly
            Kernel.compiling = False
            log.warning(
                "rematd: compiling the compress mode's kernels failed (%s: %s); they run uncompiled, slower",
                type(err).__name__,
                str(err).splitlines()[0][:300] if str(err) else "",
            )
            return self.plain(x, *args)


# Below these sizes a compiled call's fixed cost (about 25 µs on a CPU) outweighs the passes it saves;
# restoring int8 is two cheap plain passes, so its crossing comes later. The CPU converts to and from
# float8 one element at a time when uncompiled: those kernels run compiled at every size.
QUANTIZE = {"int8": Kernel(_int8, 64 * 1024), "fp8": Kernel(_fp8, 0)}
RESTORE = {torch.int8: Kernel(_restore, 256 * 1024), torch.float8_e4m3fn: Kernel(_restore, 0)}


def quantize(
    flat: torch.Tensor, fmt: str, block_size: int, *, compiled: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A 1-D tensor in ``fmt``: (values, one float32 scale per block of ``block_size`` elements, None for
    bf16); None to keep it as it is (on the CPU, a tensor holding an infinity or a NaN). ``compiled``:
    whether large tensors may go through the compiled kernel."""
    with torch.no_grad():
        if fmt == "bf16":
            return flat.to(torch.bfloat16), None
        pad = -flat.numel() % block_size
        # Detached, whole (not a view): what the compiled kernel was compiled for, whatever ``flat`` is.
        whole = F.pad(flat, (0, pad)) if pad else flat.detach()
        q, scale = QUANTIZE[fmt](whole, block_size, compiled=compiled)
        if not whole.is_cuda and not math.isfinite(float(scale.max())):
            return None
        return q, scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor | None, numel: int, dtype: torch.dtype, *, compiled: bool = True
) -> torch.Tensor:
    """The 1-D tensor :func:`quantize` was given, to within its format's error."""
    with torch.no_grad():
        if scale is None:
            return q.to(dtype)
        out: torch.Tensor = RESTORE[q.dtype](q, scale, dtype, compiled=compiled)
        return out.view(-1)[:numel]
