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

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
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


Decide = Callable[[Any, Any, Any], bool]
"""Whether an op's output is kept: ``decide(op, args, kwargs)``, called for every op of one pass of a block in
order (the forward, or the recomputation: each pass has its own, so a policy that counts counts alike)."""


COMPUTE_INTENSIVE = (
    "mm",
    "addmm",
    "bmm",
    "convolution",
    "convolution_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "upsample_bilinear2d",
    "_scaled_mm",
)
"""The compiler's compute-intensive ops (``torch._functorch.partitioners.get_default_op_list``), named here because
importing the partitioner imports dynamo and inductor: seconds in every process that imports rematd. A test holds
the two lists equal."""


def _defaults(names: Iterable[str]) -> frozenset[Any]:
    """The default overload of each named aten op this torch build has (where :func:`_ops` takes them all)."""
    packets = (getattr(aten, name, None) for name in names)
    return frozenset(p.default for p in packets if p is not None and "default" in p.overloads())


def _compute_intensive() -> frozenset[Any]:
    return _defaults(COMPUTE_INTENSIVE)


def _titan_save_ops() -> frozenset[Any]:
    """torchtitan's save list: the compiler's compute-intensive ops, the attention kernels it names, ``max``
    (a quantisation's scale), ``linear``, ``topk`` (an MoE router's choice), FlexAttention, and the collectives
    that move tokens (reduce-scatter, all-to-all)."""
    named = (
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_fused_attention_overrideable",
        "max",
        "linear",
        "topk",
    )
    found = set(_compute_intensive() | _defaults(named))
    flex = getattr(getattr(torch, "_higher_order_ops", None), "flex_attention", None)
    if flex is not None:
        found.add(flex)
    try:
        namespace = torch.ops._c10d_functional
        found.update((namespace.reduce_scatter_tensor.default, namespace.all_to_all_single.default))
    except (AttributeError, RuntimeError):
        pass
    return frozenset(found)


TITAN_SAVE_OPS = _titan_save_ops()
_MM_OPS = frozenset({aten.mm.default, aten.linear.default})
_TO_COPY = aten._to_copy.default


def megatron_policy() -> Decide:
    """Megatron's selective recomputation: keep what :data:`SAVE_OPS` produce."""
    return lambda op, args, kwargs: op in SAVE_OPS


class TitanPolicy:
    """torchtitan's per-op selective policy (``SelectiveAC``), op for op: keep the outputs of
    :data:`TITAN_SAVE_OPS` but every second matmul's (counted per pass), a device-to-host copy's always, and never
    a matmul with a router gate's weight shape (an MoE router recomputes, as torchtitan forces it to)."""

    def __init__(self, router_shapes: frozenset[tuple[int, int]] = frozenset()) -> None:
        self.router_shapes = router_shapes
        """(in, out) features of the block's router gates."""

    def __call__(self) -> Decide:
        count = [0]
        routers = self.router_shapes

        def decide(op: Any, args: Any, kwargs: Any) -> bool:
            to_host = op is _TO_COPY and str(kwargs.get("device", "")) == "cpu"
            if to_host and args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
                return True
            if op in _MM_OPS:
                shape = tuple(args[1].shape)
                if op is aten.linear.default:
                    shape = shape[::-1]
                if shape in routers:
                    return False
                count[0] += 1
                if count[0] % 2 == 0:
                    return False
            return op in TITAN_SAVE_OPS

        return decide


def outputs_of(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [t for t in result if isinstance(t, torch.Tensor)]
    return []


def _detached(x: Any) -> Any:
    """``x`` detached with its version counter shared (so a later in-place change to it can be seen), as
    ``torch.utils.checkpoint`` detaches what its selective checkpoint caches."""
    if not isinstance(x, torch.Tensor):
        return x
    guard = getattr(torch._C, "_SetExcludeDispatchKeyGuard", None)
    if guard is None:
        return x.detach()
    with guard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def _key(func: Any, args: Any) -> tuple[Any, ...]:
    """What a kept output is filed under: the op and the shapes it was called with, so that an op the
    recomputation runs once more, or once less, than the forward never hands back another call's output."""
    return (func, *(tuple(a.shape) for a in tree_leaves(args) if isinstance(a, torch.Tensor)))


class _Kept:
    """The outputs the forward kept, in call order per key, with their versions when kept."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[Any, ...], collections.deque[tuple[Any, list[int]]]] = collections.defaultdict(
            collections.deque
        )

    def keep(self, key: tuple[Any, ...], out: Any) -> None:
        out = tree_map(_detached, out)
        self.outputs[key].append((out, [t._version for t in tree_leaves(out) if isinstance(t, torch.Tensor)]))

    def take(self, key: tuple[Any, ...]) -> Any | None:
        """The next kept output of ``key``; None where there is none or it was changed in place since."""
        queue = self.outputs.get(key)
        if not queue:
            return None
        out, versions = queue.popleft()
        now = [t._version for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out if now == versions else None


class _Keep(TorchDispatchMode):
    """The forward of a selective checkpoint: keeps the outputs of the ops ``decide`` keeps (and, with ``sink``,
    collects them there so that saved-tensor accounting can count them)."""

    def __init__(self, kept: _Kept, sink: list[torch.Tensor] | None, decide: Decide) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kept = kept
        self.sink = sink
        self.decide = decide

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.decide(func, args, kwargs):
            self.kept.keep(_key(func, args), out)
            if self.sink is not None:
                self.sink.extend(outputs_of(out))
        return out


class _Replay(TorchDispatchMode):
    """The recomputation of a selective checkpoint: a kept op hands back what the forward kept, every other op
    runs again.

    Unlike ``torch.utils.checkpoint``'s own selective modes, an op the recomputation runs that the forward did
    not (a sharded set-up gathering a parameter its forward found prefetched, or prefetching in backward) simply runs:
    what happens around a block's forward is not required to repeat itself op for op. A kept output that is
    missing or was changed in place since is computed again, which gives the same value.
    """

    def __init__(self, kept: _Kept, decide: Decide) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kept = kept
        self.decide = decide

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            # The recomputation is over (to its end, or stopped once backward had what it needs): what it did
            # not take back is needed by nothing, and held here it would outlive its use until the block's
            # backward ends. A later recomputation of the block computes such outputs again.
            self.kept.outputs.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.decide(func, args, kwargs):
            out = self.kept.take(_key(func, args))
            if out is not None:
                return out
        return func(*args, **kwargs)


def selective_context(
    kept: list[torch.Tensor] | None, policy: Callable[[], Decide] = megatron_policy
) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for an eager ``checkpoint`` keeping what ``policy`` keeps (Megatron's by default); with
    ``kept``, the kept outputs are also collected there so that saved-tensor accounting can count them."""

    def make() -> tuple[Any, Any]:
        store = _Kept()
        return _Keep(store, kept, policy()), _Replay(store, policy())

    return make


def compiled_selective_context() -> tuple[Any, Any]:
    """A ``context_fn`` for a ``checkpoint`` that ``torch.compile`` traces: torch's own selective modes, which
    tag the graph's nodes for the compiler's partitioner."""
    fwd, recompute = create_selective_checkpoint_contexts(_policy)
    return fwd, recompute
