"""bench/gpu.py's strategies: how each run checkpoints (or lets rematd plan), registered by name."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.gpu_models import Job, block_list, layers
from rematd import client


@dataclass(slots=True)
class Context:
    """What a strategy's set-up gets: the model, its optimizer, the job."""

    model: nn.Module
    opt: torch.optim.Optimizer
    job: Job
    handle: client.Handle | None = None
    """Set by rematd's strategy."""
    step_fn: Callable[[torch.Tensor], None] | None = None
    """Replaces the plain forward, backward and optimizer step, given the step's token ids, where the
    strategy needs to (a compiled model)."""


Setup = Callable[[Context], None]
STRATEGIES: dict[str, Setup] = {}


def register(name: str) -> Callable[[Setup], Setup]:
    """Add a strategy: ``setup(ctx)`` prepares ``ctx.model`` (or sets ``ctx.step_fn``) before the first step.
    Compiled strategies register from their own module, named with ``--plugin``."""

    def add(fn: Setup) -> Setup:
        STRATEGIES[name] = fn
        return fn

    return add


def _hf_checkpointing(model: nn.Module, every: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed in transformers 5; the old name still works
        enable: Callable[..., None] = getattr(model, "gradient_checkpointing_enable")  # noqa: B009
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(layers(model)):
        setattr(layer, "gradient_checkpointing", i % every == 0)  # noqa: B010 (a flag each HF layer reads)


@register("none")
def _none(ctx: Context) -> None:
    return None


@register("hf-full")
def _hf_full(ctx: Context) -> None:
    _hf_checkpointing(ctx.model, 1)


@register("every-2nd")
def _every2(ctx: Context) -> None:
    _hf_checkpointing(ctx.model, 2)


@register("every-3rd")
def _every3(ctx: Context) -> None:
    _hf_checkpointing(ctx.model, 3)


def _titan_selective(ctx: Context) -> None:
    """torchtitan's own per-op selective checkpointing (``SelectiveAC``, what its ``selective`` mode applies:
    the outputs of its save list kept, but every second matmul's) wrapped around each block as torchtitan wraps
    its own: the static choice of a torchtitan user, on a Hugging Face model."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    policy = SelectiveAC(SelectiveAC.Config())
    blocks = block_list(ctx.model)
    for i, block in enumerate(blocks):
        blocks[i] = policy._wrap_block(block)


if importlib.util.find_spec("torchtitan") is not None:  # a GPU host may lack it: the strategy is left out there
    register("titan-selective")(_titan_selective)


@register("rematd")
def _rematd(ctx: Context, **options: Any) -> None:
    """rematd planning at the job's budget; ``options``: more of ``attach``'s arguments (the job's modes by
    default)."""
    job = ctx.job
    ctx.handle = client.attach(
        ctx.model,
        budget_bytes=job.budget_bytes or 2**50,
        optimizer=ctx.opt,
        margin_ratio=job.margin,
        **{"modes": job.modes or None, **options},
    )


@register("rematd-recompute")
def _rematd_recompute(ctx: Context) -> None:
    """rematd's wrappers with every block pinned to recompute, no budget: beside ``hf-full`` (the same
    recomputation), what rematd's own machinery costs a step."""
    _rematd(ctx)
    assert ctx.handle is not None
    ctx.handle.pin_modes("recompute")


def _rematd_offload(ctx: Context, *, pool: bool) -> None:
    _rematd(ctx, modes=["store", "selective", "recompute", "offload"], offload=client.OffloadConfig(pool=pool))
    assert ctx.handle is not None
    ctx.handle.pin_modes("offload")


@register("rematd-offload")
def _rematd_offload_pool(ctx: Context) -> None:
    """Every block pinned to offload, its copies into the reused pinned pool: beside ``hf-full``, what moving
    every block's activations to the host costs a step where the copies hide behind compute and where not."""
    _rematd_offload(ctx, pool=True)


@register("rematd-offload-fresh")
def _rematd_offload_fresh(ctx: Context) -> None:
    """As ``rematd-offload``, with a fresh pinned host tensor per copy: what the pool saves a step."""
    _rematd_offload(ctx, pool=False)
