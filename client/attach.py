"""``attach(model)``: how a training loop starts using rematd."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from rematd.client.arguments import (
    check_bytes,
    check_compile,
    check_flag,
    check_job,
    check_margin,
    check_optimizer,
    check_optional_flag,
    check_server,
    parse_modes,
)
from rematd.client.blocks.compress import CompressConfig, check_compress
from rematd.client.blocks.offload import OffloadConfig, check_offload
from rematd.client.handle import Handle
from rematd.client.options import AttachOptions
from rematd.client.service.stream_config import StreamConfig
from rematd.planner import Mode


def attach(
    model: nn.Module,
    *,
    server: str | None = None,
    job: str | None = None,
    budget_bytes: int | None = None,
    blocks: Sequence[nn.Module] | nn.ModuleDict | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    margin_ratio: float = 0.1,
    modes: Sequence[str | Mode] | None = None,
    token: str | None = None,
    tls: bool = False,
    root_certificates: str | os.PathLike[str] | bytes | None = None,
    fallback_after_s: float | None = 60.0,
    hard_limit_bytes: int | None = None,
    compile: bool | str = False,
    same_plan: bool | None = None,
    compress: CompressConfig | str | None = None,
    offload: OffloadConfig | None = None,
    planner_thread: bool = True,
) -> Handle:
    """Attach rematd to ``model`` and return the handle that applies its plans.

    Every argument is checked here: a bad one raises ``TypeError`` or
    ``ValueError`` naming it, before the model is touched.

    Args:
        model: the model being trained, or the engine of a sharded backend that
            trains it (its ``step()`` then ends each of the handle's steps), or
            a schedule of stages: rematd attaches to the modules of its stages on
            this rank, its ``step()`` starts each of the handle's steps, and each
            stage's plan counts the microbatches the schedule keeps alive on it
            (``docs/sharded.md`` names the set-ups and how to attach to each).
        server: ``"host:port"`` (or ``"[v6addr]:port"``, or a gRPC target
            such as ``"dns:///host:port"``) of a rematd service; ``None``
            plans in-process.
        job: the job's name on the service: 1-128 letters, digits, ``.``,
            ``_`` or ``-``, starting with a letter or digit (default: a
            random one; under ``torch.distributed`` pass the same on every rank).
        budget_bytes: the memory budget. On CUDA, the device memory the job
            may use (default: the device's capacity); on the CPU, the cap on
            bytes saved for backward during a step (default: host memory).
        blocks: the modules to checkpoint, or an ``nn.ModuleDict`` of them
            (default: the longest ``nn.ModuleList``, ``nn.Sequential`` or
            ``nn.ModuleDict`` of same-class modules).
        optimizer: when given, the handle's :meth:`Handle.step` runs after
            each ``optimizer.step()`` by itself.
        margin_ratio: the fraction of the budget the planner keeps free, in [0, 1).
        modes: the ways a block may keep activations (names, or
            :class:`rematd.planner.Mode` values), from ``"store"``,
            ``"selective"`` (keep matmul and attention outputs, recompute
            pointwise ops), ``"recompute"`` (keep only the block's input) and
            ``"offload"`` (saved activations to host memory; CUDA only) and
            ``"compress"`` (saved activations quantized to 8 bits: lossy, see
            ``docs/compress.md``).
            Default: store, selective and recompute; offload only when named
            (on a GPU it has measured slower than recomputing the same blocks),
            compress only when named (its gradients are not bitwise storing's).
        token: bearer token for the service (default: ``$REMATD_TOKEN``),
            sent as ``authorization: Bearer <token>`` metadata.
        tls: connect with TLS (implied by ``root_certificates``).
        root_certificates: PEM roots (a path or the bytes) that sign the
            service's certificate; default: the system's.
        fallback_after_s: seconds without the service after which plans are
            made in-process until it returns; ``None`` keeps the plan in force.
        hard_limit_bytes: on the CPU, a step whose bytes saved for backward
            would cross this raises :class:`rematd.client.OutOfMemory`
            (recovered from by :meth:`Handle.run_step` / :meth:`Handle.guard`).
        compile: ``True`` compiles each block with Inductor, one compiled
            function per mode with the checkpoint inside it, shared by blocks
            of the same class; a string names another ``torch.compile``
            backend (``"aot_eager"``). Every offered mode is compiled at the
            step after profiling; graphs compiled are in
            :attr:`Handle.compile_stats` and each step's ``recompiles``.
            Do not compile the model itself (``torch.compile(model)`` is
            refused, and so is a compiled submodule); compile the rest as
            functions (``torch.compile(loss_fn)``).
        same_plan: whether the ranks that share the model's parameters run one
            plan, per block the leanest any of them chose, agreed at each step's
            start (one all-reduce of an integer per block, and one for the
            plan's version, over their group: the parameters' device mesh, or
            the sharded engine's data-parallel group;
            never across stages). Default (``None``): where the set-up needs it
            (sharded parameters, tensor parallel: ranks that replay collectives or
            share one memory shape); ``True`` also makes plain or DDP ranks agree
            (over DDP's process group, else every rank); ``False`` under tensor
            parallel risks a hang.
        compress: how the ``"compress"`` mode keeps activations: a
            :class:`rematd.client.CompressConfig`, or its format's name
            (``"int8"``, the default, ``"fp8"`` or ``"bf16"``); only with
            ``"compress"`` in ``modes``.
        offload: how the ``"offload"`` mode moves activations: a
            :class:`rematd.client.OffloadConfig` (blocks fetched back ahead of
            their backward, the smallest tensor worth a copy, the reused host
            pool); only with ``"offload"`` in ``modes``.
        planner_thread: planning in this process (no ``server``), whether the
            planner runs on a thread of its own (the default: the training
            thread only hands over each step's figures, and a plan is swapped
            in at the first step boundary after it is ready) or on the training
            thread at each step's end (``False``: a run applies the same plans at
            the same steps every time, at the planner's cost on the steps it
            thinks on). With ``server`` the service plans: ``False`` is refused.
    """
    server = check_server(server)
    optimizer = check_optimizer(optimizer)
    options = AttachOptions(
        server=server,
        stream=None
        if server is None
        else StreamConfig.build(
            token=token,
            tls=check_flag("tls", tls),
            root_certificates=root_certificates,
            fallback_after_s=fallback_after_s,
        ),
        job=check_job(job),
        budget_bytes=check_bytes("budget_bytes", budget_bytes),
        margin_ratio=check_margin(margin_ratio),
        modes=parse_modes(modes),
        hard_limit_bytes=check_bytes("hard_limit_bytes", hard_limit_bytes),
        compile_backend=check_compile(compile),
        same_plan=check_optional_flag("same_plan", same_plan),
        compress=None if compress is None else check_compress(compress),
        offload=None if offload is None else check_offload(offload),
        planner_thread=check_flag("planner_thread", planner_thread),
    )
    return Handle(model, options, blocks=blocks, optimizer=optimizer)
