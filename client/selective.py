"""Selective recomputation: keep what linear layers and fused attention produce, recompute the rest.

As in Megatron-LM's selective activation recomputation: the outputs of
linear layers (``mm``, ``addmm``, convolutions) and of fused attention kernels
grow with tokens and cost the most to recompute, so they are kept; a
materialised attention core (``bmm`` of q·kᵀ and of the attention weights
with v, and the softmax, mask and dropout between them) holds tensors that
grow with the square of the sequence length and costs little to recompute,
like norms and activations. The outputs of collectives (a tensor-parallel
block's all-reduce, reduce-scatter and all-gather) are kept too, as
torchtitan's policy does: recomputing them would send them over the network
again. The same op list decides what the profile
predicts a selective block keeps and what ``torch.utils.checkpoint`` keeps
when the block runs selectively.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten


def _ops(*names: str, namespace: Any = aten) -> frozenset[Any]:
    found: set[Any] = set()
    for name in names:
        try:
            packet = getattr(namespace, name, None)
        except (AttributeError, RuntimeError):  # a namespace this torch build does not have
            packet = None
        if packet is not None:
            found.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(found)


def _functional_collectives() -> frozenset[Any]:
    try:
        namespace = torch.ops._c10d_functional
    except (AttributeError, RuntimeError):
        return frozenset()
    return _ops("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", namespace=namespace)


SAVE_OPS = (
    _ops(
        "mm",
        "addmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    | _functional_collectives()
)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def outputs_of(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [t for t in result if isinstance(t, torch.Tensor)]
    return []


class _Collect(TorchDispatchMode):
    """Collects the outputs of the kept ops (what a selective checkpoint keeps)."""

    def __init__(self, sink: list[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sink = sink

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAVE_OPS:
            self.sink.extend(outputs_of(out))
        return out


def selective_context(kept: list[torch.Tensor] | None) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``checkpoint``; with ``kept``, the kept outputs are also collected
    there so that saved-tensor accounting can count them."""

    def make() -> tuple[Any, Any]:
        fwd, recompute = create_selective_checkpoint_contexts(_policy)
        if kept is None:
            return fwd, recompute

        @contextlib.contextmanager
        def both() -> Iterator[None]:
            with fwd, _Collect(kept):
                yield

        return both(), recompute

    return make
