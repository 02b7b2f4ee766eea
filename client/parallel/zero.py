"""DeepSpeed (ZeRO stages 1, 2 and 3): what rematd must know of an engine and of the parameters ZeRO-3 partitions.

rematd attaches to the engine's module (``attach(engine)``) or to the model before ``deepspeed.initialize``
(then ``h.engine = engine``); either way the handle's step follows ``engine.step()`` at each accumulation
boundary, as it follows a plain optimizer's ``step()``.

Under ZeRO-3 every submodule gathers its parameters in a forward pre-hook and releases them after, and again
around its backward. A block that recomputes runs its forward a second time inside backward: released after
that recomputation, each parameter would be gathered a third time for the backward right behind it. So the
block's parameters are held gathered through the recomputation (:func:`kept_gathered`); the backward finds them
there, and its own post-backward hook releases them: a step gathers as often as plain ZeRO-3 does.

ZeRO-3's parameter coordinator records the order in which submodules fetch and prefetches along it. A new plan
moves recomputations, and so fetches, into or out of backward: a trace that no longer matches is invalidated
mid-step and recorded again only at the next step, two steps without prefetching. On a switch the coordinator
starts recording at once (:meth:`Zero3.switched`): one step.

DeepSpeed's internals read here (``ds_*`` attributes, the coordinator) are private: where they cannot be read,
nothing is held and the trace is left alone, which costs gathers, never correctness.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from rematd.client.attached_hooks import AttachedHook
from rematd.client.errors import UnsupportedModel
from rematd.client.parallel.agreement import Agreement
from rematd.client.parallel.base import SetUp

log = logging.getLogger("rematd.client")

_HELD = -1
"""A submodule id no module has: while a parameter's active submodules hold it, ZeRO-3 does not release it."""


def _class_names(obj: object) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def is_engine(obj: object) -> bool:
    """Whether ``obj`` is a DeepSpeed engine (checked by class name: deepspeed need not be importable)."""
    return "DeepSpeedEngine" in _class_names(obj)


def is_zero3(model: nn.Module) -> bool:
    """Whether ZeRO-3 partitions ``model``'s parameters (each carries its partition as ``ds_tensor``)."""
    return any(hasattr(p, "ds_tensor") for p in model.parameters())


def check_engine(engine: object) -> None:
    """``h.engine``'s check: a DeepSpeed engine or None."""
    if engine is not None and not is_engine(engine):
        raise TypeError(
            f"engine must be a DeepSpeed engine (deepspeed.initialize's first result), got {type(engine).__name__}"
        )


def is_zero_param(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ZeRO-3 parameter or a view of one (a gathered weight saved for backward)."""
    return hasattr(t, "ds_id") or hasattr(t._base, "ds_id")


def refuse_unsupported(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModel` for DeepSpeed set-ups rematd cannot checkpoint, naming what to change."""
    names = _class_names(model)
    if names & {"PipelineEngine", "PipelineModule"}:
        raise UnsupportedModel(
            "DeepSpeed pipeline parallelism (PipelineModule / PipelineEngine) is not supported: its stages "
            "checkpoint through the PipelineModule's activation_checkpoint_interval. Split the model into stages "
            "with torch.distributed.pipelining (PipelineStage and a schedule: ScheduleGPipe, Schedule1F1B or "
            "ScheduleInterleaved1F1B) and attach rematd to the schedule, client.attach(schedule); or pass "
            "deepspeed.initialize a plain nn.Module (ZeRO stages 1-3 are supported)"
        )
    _refuse_own_checkpointing(model)


def _refuse_own_checkpointing(model: nn.Module) -> None:
    config = getattr(getattr(model, "_config", None), "_param_dict", None) if is_engine(model) else None
    section = config.get("activation_checkpointing") if isinstance(config, dict) else None
    turned_on = sorted(k for k, v in (section or {}).items() if v is True)
    configured = False
    if "deepspeed" in sys.modules:  # importing it only to ask would cost seconds for every model
        with contextlib.suppress(Exception):
            from deepspeed import checkpointing  # type: ignore[import-untyped]

            configured = bool(checkpointing.is_configured())
    if turned_on or configured:
        what = f'"activation_checkpointing": {turned_on}' if turned_on else "deepspeed.checkpointing.configure()"
        raise UnsupportedModel(
            f"DeepSpeed's own activation checkpointing is on ({what}); rematd chooses per block what to recompute "
            'and the two would recompute twice. Remove the "activation_checkpointing" section from the DeepSpeed '
            "config and do not call deepspeed.checkpointing.configure() or deepspeed.checkpointing.checkpoint(), "
            "or do not attach rematd"
        )


class EngineStep:
    """``engine.step`` as rematd leaves it: the engine's own, then ``after()`` when it stepped the optimizer
    (at a gradient accumulation boundary, where ``global_steps`` moves)."""

    __slots__ = ("after", "own")

    def __init__(self, own: Callable[..., Any], after: Callable[[], None]) -> None:
        self.own, self.after = own, AttachedHook(after)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(self.own, "__self__", None)
        before = getattr(engine, "global_steps", None)
        out = self.own(*args, **kwargs)
        if before is None or getattr(engine, "global_steps", None) != before:
            self.after()
        return out


def follow(engine: nn.Module, after: Callable[[], None]) -> Callable[[], None]:
    """Run ``after()`` after each ``engine.step()`` that stepped; returns what undoes it."""
    own: Callable[..., Any] = engine.step  # type: ignore[assignment]
    engine.__dict__["step"] = EngineStep(own, after)

    def undo() -> None:
        if isinstance(engine.__dict__.get("step"), EngineStep):
            del engine.__dict__["step"]

    return undo


@contextlib.contextmanager
def kept_gathered(module: nn.Module) -> Iterator[None]:
    """While a block recomputes in backward: ZeRO-3 gathers its parameters and leaves them gathered for the
    backward that follows, whose hooks release them."""
    params = [p for p in module.parameters() if isinstance(getattr(p, "ds_active_sub_modules", None), set)]
    for p in params:
        p.ds_active_sub_modules.add(_HELD)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for p in params:
            p.ds_active_sub_modules.discard(_HELD)  # type: ignore[attr-defined]


def _cells(fn: object) -> list[object]:
    contents = []
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            contents.append(cell.cell_contents)
    return contents


def _named(fn: object, name: str, depth: int = 2) -> Any:
    """``fn``, or a function it wraps (by closure, as DeepSpeed's decorators do), named ``name``."""
    if getattr(fn, "__name__", "") == name:
        return fn
    for inner in _cells(fn) if depth else ():
        found = _named(inner, name, depth - 1) if callable(inner) else None
        if found is not None:
            return found
    return None


def _start_of_forward_hook(model: nn.Module) -> tuple[int, Any] | None:
    """ZeRO-3's hook on the root module (it starts each step's trace) and its place among the pre-hooks."""
    for place, hook in enumerate(model._forward_pre_hooks.values()):
        fn = _named(hook, "_start_of_forward_hook")
        if fn is not None:
            return place, fn
    return None


def coordinator(model: nn.Module) -> Any:
    """ZeRO-3's parameter coordinator of ``model`` (the engine's module), or None where it cannot be found."""
    found = _start_of_forward_hook(model)
    for owner in _cells(found[1]) if found is not None else ():
        if hasattr(owner, "get_param_coordinator"):
            return owner.get_param_coordinator()
    return None


def _ours_first(model: nn.Module) -> bool:
    """Whether rematd's step-starting pre-hook runs before ZeRO-3's (attached before ``deepspeed.initialize``)."""
    found = _start_of_forward_hook(model)
    ours = next((i for i, h in enumerate(model._forward_pre_hooks.values()) if isinstance(h, AttachedHook)), None)
    return found is not None and ours is not None and ours < found[0]


def _full_bytes(p: nn.Parameter) -> int:
    part = getattr(p, "ds_tensor", None)
    element = part.element_size() if isinstance(part, torch.Tensor) else p.element_size()
    return int(getattr(p, "ds_numel", p.numel())) * element


def _shard_bytes(p: nn.Parameter) -> int:
    part = getattr(p, "ds_tensor", None)
    return int(part.numel() * part.element_size()) if isinstance(part, torch.Tensor) else 0


def data_parallel_agreement(model: nn.Module) -> Agreement | None:
    """The ranks ZeRO-3 partitions the parameters over (the process group each parameter carries), agreeing."""
    import torch.distributed as dist

    group = next((p.ds_process_group for p in model.parameters() if hasattr(p, "ds_process_group")), None)
    size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if size < 2:
        return None
    return Agreement([group], f"ZeRO-3's data-parallel group ({size} ranks)")


class Zero3(SetUp):
    """A ZeRO-3 model as its steps see it: its shards, what it holds gathered at the peak, its trace. Its ranks
    gather in lockstep, so they run one plan: one rank recomputing alone would wait on the others' gathers."""

    name = "ZeRO-3"

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], *, agree: bool = True) -> None:
        super().__init__()
        self.model = model
        self._params = list(model.parameters())
        self._gathered = self._gathered_at_peak(blocks)
        self._rerun: tuple[bool, ...] | None = None
        self.restarts = 0
        """Times a plan switch made ZeRO-3 record its fetch order afresh."""
        self.is_weight = is_zero_param
        self.agreement = data_parallel_agreement(model) if agree else None

    @property
    def gathered_at_peak(self) -> int:
        """Full parameter bytes held gathered at the step's peak (a constant of the model's partitioning)."""
        return self._gathered

    def static_bytes(self, optimizer: torch.optim.Optimizer | None, engine: nn.Module | None) -> int:
        # As for FSDP: the rank's partitions and what ZeRO-3 holds gathered at the peak are static memory.
        return self.shard_bytes(engine) + self._gathered

    def recomputing(self, module: nn.Module) -> contextlib.AbstractContextManager[None]:
        return kept_gathered(module)

    def step_begins(self, rerun: tuple[bool, ...]) -> None:
        self.switched(rerun)

    def _gathered_at_peak(self, blocks: Sequence[nn.Module]) -> int:
        """The persistent parameters (never released), and the two largest units gathered at once when
        backward starts: a recomputed block held through its backward, and the next one prefetched. A unit is
        a block, or a module outside the blocks with parameters of its own (a language model's head)."""
        persistent = sum(_full_bytes(p) for p in self._params if getattr(p, "ds_persist", False))
        inside = {id(p) for b in blocks for p in b.parameters()}
        units = [sum(_full_bytes(p) for p in b.parameters() if not getattr(p, "ds_persist", False)) for b in blocks]
        for m in self.model.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) not in inside]
            units.append(sum(_full_bytes(p) for p in own if not getattr(p, "ds_persist", False)))
        return persistent + sum(sorted(units, reverse=True)[:2])

    def shard_bytes(self, engine: nn.Module | None) -> int:
        """This rank's partitions of the parameters and, with the engine known, of the gradients, the fp32
        master weights and the optimizer's state."""
        total = sum(_shard_bytes(p) for p in self._params)
        optimizer = getattr(engine, "optimizer", None)
        if optimizer is None:
            return total
        tensors: list[Any] = [
            *(getattr(optimizer, "fp32_partitioned_groups_flat", None) or ()),
            getattr(optimizer, "grad_partitions_flat_buffer", None),
        ]
        inner = getattr(optimizer, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            tensors.extend(state.values())
        return total + sum(
            int(t.numel() * t.element_size()) for t in tensors if isinstance(t, torch.Tensor) and t.numel() > 1
        )

    def switched(self, rerun: tuple[bool, ...]) -> None:
        """At a step's start, with whether each block runs its forward again in backward: on a change (the
        fetch order changes with it), ZeRO-3 records its fetch order from this step on, and the next one
        prefetches along it, instead of finding the old order broken mid-step and recording at the next."""
        previous, self._rerun = self._rerun, rerun
        if previous is None or previous == rerun:
            return
        coord = coordinator(self.model)
        if coord is None:
            return
        try:
            if not coord.is_invalid_trace():
                coord._invalidate_trace()
            if not _ours_first(self.model):
                coord.reset_step()  # ZeRO-3 started this step's trace already: start it again, recording
            self.restarts += 1
        except Exception:
            log.exception("rematd: restarting ZeRO-3's fetch trace failed; it re-records by itself")
