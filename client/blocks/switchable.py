"""Blocks whose way of keeping activations can be switched between steps.

The block's ``forward`` is replaced on the instance, so parameter names,
``state_dict`` keys and hooks stay exactly as the user defined them. A copy
of the model (``copy.deepcopy``, ``AveragedModel``, ``torch.save``) gets the
block's own forward back instead: it is not attached.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematd.client.blocks.checkpoint_counting import count_checkpoint
from rematd.client.blocks.compress import Compressor, constant_storages
from rematd.client.blocks.experts import expert_bank
from rematd.client.blocks.kv_caches import holds_cache
from rematd.client.blocks.mode_timing import RecomputeTimer
from rematd.client.blocks.offload import Offloader
from rematd.client.blocks.parts import PART_MODES, SwitchablePart, SwitchedForward, find_parts, router_shapes
from rematd.client.blocks.profiled_forward import profiled
from rematd.client.blocks.profiling import BlockMeasure, HostLink
from rematd.client.blocks.selective import TitanPolicy, megatron_policy, selective_context
from rematd.client.memory.accounting import SavedTensorAccounting, tensors_in
from rematd.client.parallel.base import PLAIN, SetUp
from rematd.client.thread_cost import ThreadClock
from rematd.planner import Mode, Shape

log = logging.getLogger("rematd.client")

_STORE = Mode.STORE

POLICIES = frozenset({Mode.SELECTIVE, Mode.TITAN})
"""Modes that keep what an op policy keeps (:mod:`rematd.client.blocks.selective`)."""


class CompiledVariants(Protocol):
    """What a block needs of its compiled variants (:class:`rematd.client.blocks.compiled.CompiledBlocks`)."""

    def covers(self, mode: Mode) -> bool: ...
    def run(self, block: SwitchableBlock, mode: Mode, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


MODE_CHANGES = [0]
"""Counts every change of any block's mode or profiling (process-wide): a step's start that sees the same count
as the last one knows the blocks' modes without reading each."""


class SwitchableBlock:
    """Wraps one block's forward; ``mode`` decides how the next forward runs."""

    @property
    def mode(self) -> Mode:
        """How the block's next forward keeps its activations."""
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        self._mode = mode
        MODE_CHANGES[0] += 1

    @property
    def profiling(self) -> bool:
        """Whether the block's next forward is its profile's."""
        return self._profiling

    @profiling.setter
    def profiling(self, on: bool) -> None:
        self._profiling = on
        MODE_CHANGES[0] += 1

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        accounting: SavedTensorAccounting | None,
        *,
        parts: bool = True,
    ) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.mode = Mode.STORE
        self.profiling = False
        self.profile_shape = Shape()
        self.offer: frozenset[Mode] = frozenset({Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE})
        self.host_link: HostLink | None = None
        """Offload's link to the host, where offload is offered."""
        self.measure: BlockMeasure | None = None
        self.step_shape = Shape()
        """The shape of the step being run, set by the handle at each step's start."""
        self._accounting = accounting
        self.clock = accounting.clock if accounting is not None else ThreadClock()
        """Where rematd's time on the training thread adds up (the handle's)."""
        self.cuda = self._plain = False
        """``cuda``: whether the block runs on a CUDA device (from its last input off :meth:`_forward`'s short
        way); ``_plain``: whether a storing forward may take that short way (timed on the host, eager, its parts
        unswitched)."""
        self.timer: RecomputeTimer | None = None
        """Where rematerialisations are timed (set by the handle)."""
        self.offloader: Offloader | None = None
        """Where offloaded activations go (set by the handle; without one, autograd's ``save_on_cpu``)."""
        self.compressor: Compressor | None = None
        """Where compressed activations are packed (set by the handle; without one a compressing block stores)."""
        self._in_forward = False
        self._recording: Callable[..., Any] | None = None
        """While a lean profile runs: the block's forward as the checkpoint's first pass runs it, measured."""
        self._cache_logged = False
        self.compiled: CompiledVariants | None = None
        """The compiled variants this block runs (``attach(..., compile=...)``); None: eager."""
        self.setup: SetUp = PLAIN
        """The parallel set-up (set at the first step): what its weights are, what a recomputation runs in."""
        self.parts: dict[Mode, SwitchablePart] = (
            {mode: SwitchablePart(mode, n, m, self) for mode, (n, m) in find_parts(module).items()} if parts else {}
        )
        """The block's parts that recompute on their own (its attention, its MLP), found by name."""
        self._parts_on = bool(self.parts)
        """Whether the parts' forwards are switched (:meth:`SwitchablePart.engage`): while profiling, or in a part
        mode."""
        # torchtitan's selective policy, for this block's router gates; the block's mixture of experts' expert bank
        # (:mod:`rematd.client.blocks.experts`), where it has one (eager blocks only).
        self.titan, self.bank = TitanPolicy(router_shapes(module)), expert_bank(module) if parts else None
        self._had_instance_forward = "forward" in module.__dict__
        self._original: Callable[..., Any] = module.forward
        module.forward = self._switched_forward = SwitchedForward(self)
        # Whether the block runs its own forward, nothing of rematd's around it (:meth:`run_bare`).
        self.bare = False

    @property
    def checkpointed(self) -> bool:
        """Whether the block keeps less than everything (any mode but STORE)."""
        return self.mode != Mode.STORE

    @checkpointed.setter
    def checkpointed(self, on: bool) -> None:
        self.mode = Mode.RECOMPUTE if on else Mode.STORE

    def restore(self) -> None:
        for part in self.parts.values():
            part.restore()
        self._own_forward()

    def _own_forward(self) -> None:
        if self._had_instance_forward:
            self._set_forward(self._original)
        else:
            self.module.__dict__.pop("forward", None)

    @property
    def may_run_bare(self) -> bool:
        """Whether a step that neither times storing blocks nor counts saved tensors may run this block's own
        forward with nothing of rematd's around it: it stores, eager, its parts unswitched, and profiles no
        more."""
        return (
            self.mode is _STORE
            and not self.profiling
            and self.compiled is None
            and not self._parts_on
            and self.timer is not None
        )

    @property
    def parts_switched(self) -> bool:
        """Whether the block's parts run rematd's forward (profiling, a part mode, or until the block's next
        forward after one)."""
        return self._parts_on

    def run_bare(self, on: bool) -> None:
        """From the next forward on, run the block's own forward (``on``), or rematd's around it. Set at a step's
        start only, with its mode: a block that runs bare follows no change of mode."""
        if on == self.bare:
            return
        self.bare = on
        if on:
            self._own_forward()
        else:
            self._set_forward(self._switched_forward)

    def _set_forward(self, forward: Callable[..., Any]) -> None:
        if type(self.module).__setattr__ is nn.Module.__setattr__:
            # Straight into the instance's dict: nn.Module's __setattr__ looks the name up among parameters,
            # buffers and submodules first, for every block twice in each timed step.
            self.module.__dict__["forward"] = forward
        else:
            self.module.forward = forward  # a class of its own __setattr__ sees the change

    def _counting(self) -> SavedTensorAccounting | None:
        acct = self._accounting
        return acct if acct is not None and acct.active else None

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._original(*args, **kwargs)
        entered = perf_counter()
        clock = self.clock
        acct = self._accounting
        # What is saved while a block runs is the block's; the rest is saved outside the blocks.
        if acct is not None:
            acct.block_depth += 1
        timer = self.timer
        if self._mode is _STORE and self._plain and timer is not None and not self._profiling:
            # The common case, once per block and step: a storing block timed on the host clock, one pair of
            # readings both timing its forward for the planner and leaving it out of rematd's time. It touches
            # as little as it can: after the block's own work little of rematd's is still in the caches.
            start = perf_counter()
            clock.spent += start - entered
            try:
                return self._original(*args, **kwargs)
            finally:
                end = perf_counter()
                timer.store_seconds += end - start
                timer.store_blocks += 1
                if acct is not None:
                    acct.block_depth -= 1
                clock.spent += perf_counter() - end
        clock.mark = entered
        try:
            return self._switched(args, kwargs)
        finally:
            if acct is not None:
                acct.block_depth -= 1
            clock.spent += perf_counter() - clock.mark

    def _switched(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.profiling:
            self._engage_parts(True)
            # The profiling step's measuring is the block's forward, run and measured: the model's time.
            return self.clock.call(self._profiled, *args, **kwargs)
        mode = self._mode_to_run(args, kwargs)
        # Where the block runs, from its input (off the short way, which a block on a device never takes).
        self.cuda = any(t.is_cuda for t in tensors_in([args, kwargs]))
        if self._parts_on != (mode in PART_MODES):
            self._engage_parts(mode in PART_MODES)
        timer = self.timer
        # Whether the next storing forward may take :meth:`_forward`'s short way (set here, where a first call
        # of each step's blocks comes after the step's start has set where they run).
        self._plain = timer is not None and not self.cuda and self.compiled is None and not self._parts_on
        if timer is None or self._compiled_checkpoint(mode):
            # A compiled checkpoint rematerialises inside its graph, out of the timer's reach: with its
            # forward timed alone it would look free in backward, so it keeps the profile's price.
            return self._model_forward(mode, args, kwargs)
        # Every mode's forward is timed, storing's too: the baseline the others' forward costs are taken against.
        if self.cuda or self.compiled is not None:
            return timer.forward(mode, self._model_forward, self.cuda, mode, args, kwargs)
        # On the host clock (the common eager path, once per block and step): one pair of readings both times the
        # mode's forward for the planner and leaves it out of rematd's time.
        clock = self.clock
        start = perf_counter()
        clock.spent += start - clock.mark
        try:
            if mode is Mode.STORE:
                return self._original(*args, **kwargs)
            return self.eager_forward(mode, args, kwargs)
        finally:
            end = perf_counter()
            timer.add_forward(mode, end - start)
            clock.mark = end

    def _model_forward(self, mode: Mode, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The block's forward in ``mode``: the model's time (and torch's checkpoint's), not rematd's."""
        return self.clock.call(self._mode_forward, mode, args, kwargs)

    def _mode_to_run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Mode:
        """The mode this forward runs in: the block's, but storing when the caller handed it a cache, and
        recomputing the whole block for a part it does not have (a pin may name one)."""
        mode = self.mode
        if mode not in (Mode.STORE, Mode.OFFLOAD, Mode.COMPRESS) and self._keeps_for_cache(args, kwargs):
            return Mode.STORE
        if mode in PART_MODES and mode not in self.parts:
            return Mode.RECOMPUTE
        return mode

    def _engage_parts(self, on: bool) -> None:
        if on == self._parts_on or not self.parts:
            return
        self._parts_on = on
        if on:
            self._plain = False
        for part in self.parts.values():
            part.engage(on)

    def _compiled_checkpoint(self, mode: Mode) -> bool:
        return mode in (Mode.SELECTIVE, Mode.RECOMPUTE) and self.compiled is not None and self.compiled.covers(mode)

    def _mode_forward(self, mode: Mode, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.compiled is not None and self.compiled.covers(mode):
            return self.compiled.run(self, mode, args, kwargs)
        return self.eager_forward(mode, args, kwargs)

    def eager_forward(self, mode: Mode, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The block's forward in ``mode`` without compiling and without timing it."""
        if mode == Mode.STORE:
            return self._original(*args, **kwargs)
        if mode == Mode.OFFLOAD:
            return self._offloaded(*args, **kwargs)
        if mode == Mode.COMPRESS:
            return self.compressed(functools.partial(self._original, *args, **kwargs), args, kwargs)
        part = self.parts.get(mode)
        if part is not None:
            part.active = True
            try:
                return self._original(*args, **kwargs)
            finally:
                part.active = False
        acct = self._counting()
        kept: list[torch.Tensor] | None = [] if acct is not None and mode in POLICIES else None
        self._in_forward = True
        try:
            if mode in POLICIES:
                output = checkpoint(
                    functools.partial(self._run, mode),
                    *args,
                    use_reentrant=False,
                    context_fn=selective_context(kept, self.titan if mode == Mode.TITAN else megatron_policy),
                    **kwargs,
                )
            else:
                output = checkpoint(functools.partial(self._run, mode), *args, use_reentrant=False, **kwargs)
        finally:
            self._in_forward = False
        count_checkpoint(self, mode, args, kwargs, output, kept or [])
        return output

    def count_part(self, mode: Mode, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """On the CPU's accounting, a part that recomputed: what it brings back in backward (its input is saved
        for backward as any tensor is, under the accounting's hooks)."""
        acct = self._counting()
        if acct is not None:
            acct.rematerialise(self._transient_bytes(mode), tensors_in([output]), tensors_in([args, kwargs]))

    def _offloaded(self, *args: Any, **kwargs: Any) -> Any:
        offloader = self.offloader
        if offloader is None:
            pin = any(t.is_cuda for t in tensors_in([args, kwargs]))
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return self._original(*args, **kwargs)
        with offloader.block() as group:
            output = self._original(*args, **kwargs)
        offloader.on_output(group, output)
        return output

    def compressed(self, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``run()``, the block's forward (eager or compiled) on ``args``/``kwargs``, with what it saves
        for backward compressed."""
        compressor = self.compressor
        if compressor is None:
            return run()
        weights = self.setup.block_weights(self.module)
        with compressor.block(constant_storages(tensors_in([args, kwargs])), weights):
            return run()

    def _keeps_for_cache(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A block handed a key/value cache by the caller runs once, storing: a recompute would update it again."""
        if not holds_cache(args, kwargs):
            return False
        if not self._cache_logged:
            self._cache_logged = True
            log.warning(
                "rematd: block %s was handed a key/value cache in a forward with gradients; it keeps its "
                "activations in such forwards so that the cache is updated once (no cache: use_cache=False)",
                self.name,
            )
        return True

    def _run(self, mode: Mode, *args: Any, **kwargs: Any) -> Any:
        """The block's own forward, as the checkpoint calls it: in forward, and again in backward to
        rematerialise what it did not keep, which is timed for the planner."""
        if self._in_forward:
            recording = self._recording
            if recording is not None:
                return recording(*args, **kwargs)
            return self._original(*args, **kwargs)
        clock = self.clock
        clock.enter()
        try:
            with self.setup.recomputing(self.module):
                if self.timer is None:
                    return clock.call(self._original, *args, **kwargs)
                return self.timer.run(mode, clock.call, self.cuda, self._original, *args, **kwargs)
        finally:
            clock.leave()

    def _transient_bytes(self, mode: Mode) -> int:
        if self.measure is None:
            return 0
        cost = next((m for m in self.measure.modes if m.mode == mode), None)
        return cost.transient.at(self.profile_shape, self.step_shape) if cost is not None else 0

    def _profiled(self, *args: Any, **kwargs: Any) -> Any:
        """The block's forward, measured for the profile (:func:`~rematd.client.blocks.profiled_forward.profiled`)."""
        return profiled(self, args, kwargs)
