"""A block's parts, its attention and its MLP (or experts), each able to recompute on its own.

Megatron-Core recomputes chosen submodules of a layer (``recompute_modules``: ``core_attn``, ``mlp``, ...)
and keeps the rest. rematd's ``attention`` and ``mlp`` modes do the same with a block's child module found
by name (``self_attn``, ``attn``, ``attention``; ``mlp``, ``feed_forward``, ``ffn``, ``block_sparse_moe``,
``moe``, as Hugging Face's, timm's and torchtitan's models name them): the block runs as storing runs it,
but that child runs under ``torch.utils.checkpoint`` and keeps only its input; its activations come back in
backward by running it again. A block none of whose children is named so offers neither mode.

The child's ``forward`` is replaced on the instance, as the block's is, so parameter names, ``state_dict``
keys and hooks stay as the user defined them; a copy of the model gets the child's own forward back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, SupportsIndex

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematd.client.blocks.mode_timing import RecomputeTimer
from rematd.client.memory.accounting import tensors_in
from rematd.client.parallel.base import SetUp
from rematd.client.thread_cost import ThreadClock
from rematd.planner import Mode

PART_NAMES: dict[Mode, tuple[str, ...]] = {
    Mode.ATTENTION: ("self_attn", "attn", "attention", "self_attention"),
    Mode.MLP: ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe"),
}
"""Per mode, the names of the child module it recomputes, the first one found."""
PART_MODES = frozenset(PART_NAMES)


class Recorder(Protocol):
    """What profiles a part (:class:`rematd.client.blocks.profiling.Profiler`)."""

    def enter_part(self, mode: Mode, inputs: list[torch.Tensor]) -> None: ...
    def leave_part(self, mode: Mode, seconds: float) -> None: ...


class Owner(Protocol):
    """What a part needs of its block (:class:`rematd.client.blocks.switchable.SwitchableBlock`)."""

    timer: RecomputeTimer | None
    setup: SetUp
    clock: ThreadClock
    cuda: bool

    def count_part(self, mode: Mode, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None: ...


def find_parts(block: nn.Module) -> dict[Mode, tuple[str, nn.Module]]:
    """Per part mode, the block's child it recomputes (name, module), where the block has one with parameters."""
    children = dict(block.named_children())
    found: dict[Mode, tuple[str, nn.Module]] = {}
    for mode, names in PART_NAMES.items():
        for name in names:
            child = children.get(name)
            if isinstance(child, nn.Module) and any(p.requires_grad for p in child.parameters()):
                found[mode] = (name, child)
                break
    return found


class _Slot:
    """Where a tensor input of a part goes among the distinct tensors its checkpoint is given."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Switched(Protocol):
    def _forward(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def _original(self) -> Callable[..., Any]: ...


class SwitchedForward:
    """What a switched module's ``forward`` attribute holds (a block's, or a part's).

    Copied or pickled, it becomes the forward the module had before (for a forward defined by the class,
    ``getattr(copy, "forward")``: the copy's own), so a copy neither carries the handle's locks nor needs
    rematd to load.
    """

    __slots__ = ("owner",)

    def __init__(self, owner: _Switched) -> None:
        self.owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner._forward(*args, **kwargs)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        return self.owner._original.__reduce_ex__(protocol)


class SwitchablePart:
    """One part of a block; ``active`` (set by the block around its forward) makes it recompute.

    Its forward is switched only while the block may need it (:meth:`engage`): a step whose block runs no part
    mode and does not profile calls the part's own forward, with nothing of rematd's in between.
    """

    def __init__(self, mode: Mode, name: str, module: nn.Module, owner: Owner) -> None:
        self.mode = mode
        self.name = name
        self.module = module
        self.owner = owner
        """The block: where rematerialisations are timed, what they run in, how the CPU's accounting counts them."""
        self.active = False
        self.recorder: Recorder | None = None
        """While the block profiles: what measures this part's activations and time."""
        self._in_forward = False
        self._had_instance_forward = "forward" in module.__dict__
        self._original: Callable[..., Any] = module.forward
        self.engaged = False
        self.engage(True)

    def engage(self, on: bool) -> None:
        """Switch the part's forward (``on``), or give the module its own back."""
        if on == self.engaged:
            return
        self.engaged = on
        if on:
            self.module.forward = SwitchedForward(self)
        else:
            self.restore()

    def restore(self) -> None:
        self.engaged = False
        if self._had_instance_forward:
            self.module.forward = self._original
        else:
            self.module.__dict__.pop("forward", None)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        clock = self.owner.clock
        clock.enter()
        try:
            return self._switched(clock, args, kwargs)
        finally:
            clock.leave()

    def _switched(self, clock: ThreadClock, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        recorder = self.recorder
        if recorder is not None:
            return clock.call(self._recorded, recorder, args, kwargs)
        if not self.active or not torch.is_grad_enabled():
            return clock.call(self._original, *args, **kwargs)
        # The checkpoint hands its recomputation each input apart: a tensor given twice (attention's query, key
        # and value, one tensor) is given once and put back where it was, so that the forward run again takes
        # the path it took (``nn.MultiheadAttention`` projects ``q is k is v`` at once).
        unique: list[torch.Tensor] = []
        where: dict[int, int] = {}

        def slot(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if id(v) not in where:
                where[id(v)] = len(unique)
                unique.append(v)
            return _Slot(where[id(v)])

        held_args = [slot(a) for a in args]
        held_kwargs = {k: slot(v) for k, v in kwargs.items()}

        def again(*tensors: torch.Tensor) -> Any:
            def put(v: Any) -> Any:
                return tensors[v.index] if isinstance(v, _Slot) else v

            return self._run(*(put(a) for a in held_args), **{k: put(v) for k, v in held_kwargs.items()})

        self._in_forward = True
        try:
            output = clock.call(checkpoint, again, *unique, use_reentrant=False)
        finally:
            self._in_forward = False
        self.owner.count_part(self.mode, args, kwargs, output)
        return output

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        """The part's own forward, as the checkpoint calls it: in forward, and again in backward, timed. Again,
        it is called as a module is (its hooks run, as a child's do when the whole block recomputes); it is
        not active then, so the call runs its own forward."""
        if self._in_forward:
            return self._original(*args, **kwargs)
        timer = self.owner.timer
        clock = self.owner.clock
        clock.enter()
        try:
            with self.owner.setup.recomputing(self.module):
                if timer is None:
                    return clock.call(self.module, *args, **kwargs)
                return timer.run(self.mode, clock.call, self.owner.cuda, self.module, *args, **kwargs)
        finally:
            clock.leave()

    def _recorded(self, recorder: Recorder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inputs = tensors_in([args, kwargs])
        cuda = any(t.is_cuda for t in inputs)
        recorder.enter_part(self.mode, inputs)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return self._original(*args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize()
            recorder.leave_part(self.mode, time.perf_counter() - start)


def router_shapes(block: nn.Module) -> frozenset[tuple[int, int]]:
    """The (in, out) features of a mixture of experts' router gates in ``block``: a linear layer whose name
    holds ``router.gate`` (torchtitan's), or named ``gate`` or ``router`` beside the ``experts`` it routes to
    (Hugging Face's). torchtitan's selective policy recomputes every matmul of those shapes."""
    shapes = set()
    for name, sub in block.named_modules():
        if not isinstance(sub, nn.Linear):
            continue
        parent_name, _, own = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        if "router.gate" in name or (own in ("gate", "router") and hasattr(parent, "experts")):
            shapes.add((sub.in_features, sub.out_features))
    return frozenset(shapes)
