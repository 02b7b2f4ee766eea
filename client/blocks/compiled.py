"""Compiled variants of switchable blocks: ``attach(model, compile=True)``.

Each mode a block can run in is its own compiled function, with the
checkpoint *inside* the compiled region (torchtitan's order: wrap, then
compile). ``checkpoint`` around an already compiled block fails in recompute
(the saved and recomputed tensors' metadata differ), so the mode switch happens
in Python, outside every graph, by picking which compiled function to call.

The functions take the block as an argument (dynamo inlines built-in and user
modules, their parameters becoming graph inputs), so every block of the same
class shares one graph per mode, instead of each instance compiling its own.
Each handle compiles fresh copies of the functions (new code objects), so
dynamo's per-function recompile limit counts one handle's graphs only.

Every offered mode is compiled ahead, at the first step after profiling, on a
detached copy of that step's input to the first block that runs compiled, and
again whenever one mode recompiles for a new shape: for a model of one block
class a plan switch seldom waits for a compile. Blocks of another class (an
encoder-decoder's decoder layers) compile each mode at their first use, and a
shape not seen ahead compiles when it arrives, so a step can still compile.
The planner prices no compile: a step in which any graph was compiled reports
no mode timings (they would carry the compile), and the compiled checkpoint
variants' forwards are never timed (their rematerialisation in backward runs
inside the graph, out of the timer's reach), so those modes keep the profile's
price. Sequence lengths are dynamic after the second one seen (dynamo's
automatic dynamic shapes). A mode whose graphs, counted over every block class
together, reach :data:`MAX_GRAPHS_PER_MODE` compiles no more (logged once): its
graphs still serve the shapes they cover, any other shape runs eagerly, so
rematd never drives dynamo to its recompile limit.

``compile=`` needs torch 2.6 or later (``torch.compiler.set_stance``); ``attach``
refuses it on older torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematd.client.blocks.selective import compiled_selective_context
from rematd.client.blocks.switchable import SwitchableBlock
from rematd.client.memory.accounting import tensors_in
from rematd.planner import Mode

log = logging.getLogger("rematd.client")

MAX_GRAPHS_PER_MODE = 6
"""Graphs one mode's compiled function may build before it compiles no more: the first shape,
the dynamic recompile at the second length, and room for a graph break or a dtype change
(dynamo's own limit per function, ``torch._dynamo.config.recompile_limit``, is 8)."""

COMPILED_MODES = frozenset({Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE, Mode.OFFLOAD, Mode.COMPRESS})
"""Offload and compress are the compiled store variant run under the block's offloader or compressor:
their host copies and quantizations are saved-tensor hooks outside the graph, which compose with any
compiled function (what they see is what the graph saves for backward)."""

MIN_TORCH = (2, 6)
"""``compile=`` needs ``torch.compiler.set_stance`` (to run a capped mode's new shapes eagerly)."""


def check_torch_version(version: str) -> None:
    """ValueError naming ``compile`` when ``version`` (``torch.__version__``) is older than :data:`MIN_TORCH`."""
    parts = version.split("+")[0].split(".")
    try:
        have = (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0))
    except (IndexError, ValueError):
        return  # a version string of an unknown form: let torch itself tell
    if have < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ValueError(f"compile= needs torch >= {need} (torch.compiler.set_stance); this is torch {version}")


_handles = itertools.count()


def _store(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return type(module).forward(module, *args, **kwargs)


def _selective(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return checkpoint(
        type(module).forward, module, *args, use_reentrant=False, context_fn=compiled_selective_context, **kwargs
    )


def _recompute(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return checkpoint(type(module).forward, module, *args, use_reentrant=False, **kwargs)


_VARIANTS: dict[Mode, Callable[..., Any]] = {Mode.STORE: _store, Mode.SELECTIVE: _selective, Mode.RECOMPUTE: _recompute}


def _fresh(fn: Callable[..., Any], tag: int) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own: dynamo keeps compiled graphs per code object."""
    code = fn.__code__.replace(co_name=f"rematd_{fn.__name__.strip('_')}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name)


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """What compiling the blocks' variants has cost so far."""

    graphs: int
    """Graphs compiled (every mode, every shape), the first compile of each mode included."""
    seconds: float
    """Wall seconds of the calls that compiled them (forward graphs; a backward compiled
    ahead is included, one compiled lazily by a later recompile is in that step's time)."""
    by_mode: dict[Mode, int]
    """Graphs compiled per mode."""
    capped_modes: frozenset[Mode]
    """Modes that reached :data:`MAX_GRAPHS_PER_MODE`: they compile no more graphs, and a shape
    their graphs do not cover runs eagerly."""
    failed_modes: frozenset[Mode]
    """Modes whose compile failed: they run eagerly (the step goes on)."""


class _Counting:
    """The backend ``torch.compile`` calls: counts each graph compiled, then hands it on."""

    def __init__(self, owner: CompiledBlocks, name: str) -> None:
        import torch._dynamo

        self.owner = owner
        self.inner = torch._dynamo.lookup_backend(name)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled = self.inner(gm, example_inputs)
        self.owner._graph_compiled()
        return compiled


class CompiledBlocks:
    """One handle's compiled variants, shared by all its blocks."""

    def __init__(self, backend: str) -> None:
        import torch._dynamo.exc  # only with compile=: importing dynamo takes seconds

        self.backend = backend
        self._errors: tuple[type[BaseException], ...] = (torch._dynamo.exc.TorchDynamoException,)
        """What a failed compile raises (dynamo wraps the backend's errors in them)."""
        tag = next(_handles)
        counting = _Counting(self, backend)
        self._fns = {
            mode: torch.compile(_fresh(fn, tag), backend=counting, dynamic=None) for mode, fn in _VARIANTS.items()
        }
        self._by_mode = dict.fromkeys(_VARIANTS, 0)
        self._graphs = 0
        self._seconds = 0.0
        self._taken = (0, 0.0)
        self._compiling: Mode = Mode.STORE
        self._capped: set[Mode] = set()
        self._failed: set[Mode] = set()
        self._warm = False

    @staticmethod
    def supports(block: SwitchableBlock) -> bool:
        """A forward set on the instance (not the class's) is not the block's own: left eager."""
        return not block._had_instance_forward

    def covers(self, mode: Mode) -> bool:
        return mode in COMPILED_MODES and self._variant(mode) not in self._failed

    @staticmethod
    def _variant(mode: Mode) -> Mode:
        return Mode.STORE if mode in (Mode.OFFLOAD, Mode.COMPRESS) else mode

    def stats(self) -> CompileStats:
        return CompileStats(
            graphs=self._graphs,
            seconds=self._seconds,
            by_mode=dict(self._by_mode),
            capped_modes=frozenset(self._capped),
            failed_modes=frozenset(self._failed),
        )

    def take(self) -> tuple[int, float]:
        """Graphs compiled and their seconds since the last call (one step's share)."""
        graphs, seconds = self._graphs - self._taken[0], self._seconds - self._taken[1]
        self._taken = (self._graphs, self._seconds)
        return graphs, max(0.0, seconds)

    def _graph_compiled(self) -> None:
        self._graphs += 1
        self._by_mode[self._compiling] += 1

    def run(self, block: SwitchableBlock, mode: Mode, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._warm:
            self._warm = True
            self._warm_up(block, args, kwargs)
        variant = self._variant(mode)
        if variant in self._failed:
            return block.eager_forward(mode, args, kwargs)  # it failed ahead: no second try, no second log
        before = self._by_mode[variant]
        try:
            if mode == Mode.OFFLOAD:
                output = self._offloaded(block, args, kwargs)
            elif mode == Mode.COMPRESS:
                output = block.compressed(lambda: self._call(Mode.STORE, block.module, args, kwargs), args, kwargs)
            else:
                output = self._call(variant, block.module, args, kwargs)
        except self._errors as err:
            # Compiling happens before the graph runs: nothing of this forward happened yet. The caller
            # is already timing this forward: the eager run goes untimed, or the block would count twice.
            self._fail(variant, err)
            return block.eager_forward(mode, args, kwargs)
        if self._by_mode[variant] != before:
            # A new shape (most often the second length, which makes the graphs dynamic): the other
            # modes would recompile at their next use, so they compile now and a switch waits for none.
            self._warm_up(block, args, kwargs, skip=variant)
        acct = block._counting()
        if acct is not None and variant != Mode.STORE:
            # The compiled function's saved tensors pass the accounting's hooks; what backward
            # brings back does not, so it comes from the profile as in eager checkpointing.
            acct.rematerialise(block._transient_bytes(mode), tensors_in([output]), tensors_in([args, kwargs]))
        return output

    def _offloaded(self, block: SwitchableBlock, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The compiled store variant with its saved tensors sent to the host by the block's offloader
        (side stream, prefetch, timed wait), as an eager offloaded block's are."""
        offloader = block.offloader
        if offloader is None:
            pin = any(t.is_cuda for t in tensors_in([args, kwargs]))
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return self._call(Mode.STORE, block.module, args, kwargs)
        with offloader.block() as group:
            output = self._call(Mode.STORE, block.module, args, kwargs)
        offloader.on_output(group, output)
        return output

    def _call(self, variant: Mode, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fn = self._fns[variant]
        if variant in self._capped:
            # Graphs already built still serve the shapes they cover; any other runs eagerly.
            with torch.compiler.set_stance("eager_on_recompile"):
                return fn(module, args, kwargs)
        before = self._graphs
        self._compiling = variant
        start = time.perf_counter()
        output = fn(module, args, kwargs)
        if self._graphs != before:
            self._seconds += time.perf_counter() - start
            self._cap(variant)
        return output

    def _fail(self, variant: Mode, err: BaseException) -> None:
        self._failed.add(variant)
        log.warning(
            "rematd: compiling the %s variant failed (%s: %s); blocks run it eagerly from now on",
            variant.name.lower(),
            type(err).__name__,
            str(err)[:300],
        )

    def _cap(self, variant: Mode) -> None:
        if self._by_mode[variant] >= MAX_GRAPHS_PER_MODE and variant not in self._capped:
            self._capped.add(variant)
            log.warning(
                "rematd: the compiled %s variant has built %d graphs; it compiles no more (a shape its graphs "
                "do not cover runs eagerly), so that dynamo's recompile limit is never reached",
                variant.name.lower(),
                self._by_mode[variant],
            )

    def _warm_up(
        self, block: SwitchableBlock, args: tuple[Any, ...], kwargs: dict[str, Any], skip: Mode | None = None
    ) -> None:
        """Compile every offered mode's forward and backward (but ``skip``, and modes at their bound)
        on a detached copy of this input.

        Gradients are taken with ``torch.autograd.grad`` (nothing accumulates into ``.grad``),
        under saved-tensor hooks of its own (the step's accounting does not see it), with the
        random state and the block's buffers put back afterwards (the step's numbers do not change).
        """
        module = block.module
        modes = {self._variant(m) for m in block.offer if m in COMPILED_MODES} - self._capped - {skip}
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        devices = sorted(
            {t.device.index for t in tensors_in([args, kwargs]) if t.is_cuda and t.device.index is not None}
        )
        copies = _detached(args), _detached(kwargs)
        params = [p for p in module.parameters() if p.requires_grad]
        try:
            with (
                torch.random.fork_rng(devices=devices),
                torch.autograd.graph.saved_tensors_hooks(_same, _same),
            ):
                for variant in sorted(modes, key=lambda m: m.value):
                    inputs = [*params, *(t for t in tensors_in(copies) if t.requires_grad)]
                    before = self._graphs
                    start = time.perf_counter()
                    self._compiling = variant
                    try:
                        output = self._fns[variant](module, *copies)
                        outs = [t for t in tensors_in([output]) if t.requires_grad]
                        if outs and inputs:
                            torch.autograd.grad(outs, inputs, [torch.ones_like(t) for t in outs], allow_unused=True)
                    except self._errors as err:
                        self._fail(variant, err)
                    if self._graphs != before:
                        self._seconds += time.perf_counter() - start
                        self._cap(variant)
        except Exception as err:
            # The step goes on; a mode not compiled ahead compiles at its first use.
            log.warning("rematd: compiling the blocks' variants ahead failed (%s: %s)", type(err).__name__, err)
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value
