"""Training a real model with and without rematd, side by side, through every mode.

Two copies of one model (same seed, same weights) take the same steps; the
attached copy switches modes between steps with ``h.pin_modes`` (the first
step is the profiling step). Each step's loss, every gradient, every
parameter and buffer (batch-norm statistics) must be bitwise those of the
copy without rematd, and a block that does not store must really have run
again in backward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rematd import client
from rematd.client import introspect
from rematd.planner import Mode

Inputs = dict[str, Any]


@dataclass(frozen=True)
class Case:
    """One model of the matrix: how to build it (seeded), a batch, and its loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[int], Inputs]
    loss: Callable[[nn.Module, Inputs], torch.Tensor]


def hf_loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    out = model(**inputs)
    loss: torch.Tensor = out.loss
    return loss


def mixed(n: int) -> list[Mode]:
    cycle = (Mode.SELECTIVE, Mode.MLP, Mode.RECOMPUTE, Mode.ATTENTION, Mode.STORE, Mode.TITAN)
    return [cycle[i % len(cycle)] for i in range(n)]


def schedule(n: int, *, offload: bool = False) -> list[list[Mode] | None]:
    """The modes pinned before each step: none for the profiling step, then every mode, a mix, and back."""
    plans: list[list[Mode] | None] = [
        None,
        [Mode.SELECTIVE] * n,
        [Mode.TITAN] * n,
        [Mode.ATTENTION] * n,
        [Mode.MLP] * n,
        [Mode.RECOMPUTE] * n,
        mixed(n),
    ]
    if offload:
        plans.append([Mode.OFFLOAD] * n)
    plans.append([Mode.STORE] * n)
    return plans


class Rematerialised:
    """Counts, per block, the forwards of its submodules that run inside backward (only a recompute does)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self.counts = [0] * len(blocks)
        self._handles = []
        for i, block in enumerate(blocks):
            for m in block.modules():
                if m is not block:
                    self._handles.append(m.register_forward_pre_hook(self._hook(i)))

    def _hook(self, i: int) -> Callable[..., None]:
        def count(*_: object) -> None:
            if torch._C._current_graph_task_id() != -1:
                self.counts[i] += 1

        return count

    def take(self) -> list[int]:
        out, self.counts = self.counts, [0] * len(self.counts)
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def train_side_by_side(
    case: Case,
    *,
    device: str = "cpu",
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    scaler: Callable[[], torch.amp.GradScaler] | None = None,
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
    offload: bool = False,
) -> client.Handle:
    """Train ``case`` with and without rematd through :func:`schedule`; assert every step's numbers are equal.

    Returns the (closed) handle, for checks of what it saw.
    """
    ref = wrap(case.build()).to(device).train()
    model = wrap(case.build()).to(device).train()
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scale_ref, scale = (scaler(), scaler()) if scaler is not None else (None, None)
    h = client.attach(model)
    names = dict(model.named_modules())
    blocks = [names[n] for n in h.blocks]
    counter = Rematerialised(blocks)
    exact = device == "cpu"
    # rematd's training forwards run with use_cache=False (as Hugging Face's checkpointing does); so does the
    # reference. A forward that builds a cache differs in the last bits (the cache copies keys and values).
    cached = any("use_cache" in inspect.signature(m.forward).parameters for m in ref.modules())
    reference = {"use_cache": False} if cached else {}
    try:
        for step, pinned in enumerate(schedule(len(blocks), offload=offload)):
            if pinned is not None:
                h.pin_modes(pinned)
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.batch(step).items()}
            losses = []
            for m, o, s in ((ref, opt_ref, scale_ref), (model, opt, scale)):
                torch.manual_seed(100 + step)  # dropout draws the same numbers in both
                with autocast():
                    loss = case.loss(m, inputs if m is model else {**inputs, **reference})
                (s.scale(loss) if s is not None else loss).backward()
                losses.append(loss.detach())
                if m is model:
                    modes = list(h.modes)
                if s is not None:
                    s.step(o)
                    s.update()
                else:
                    o.step()
            assert torch.isfinite(losses[0]), f"step {step}: the model does not train ({losses[0]})"
            assert torch.equal(losses[0], losses[1]), f"step {step} ({pinned}): loss {losses[0]} != {losses[1]}"
            # The profiling step (nothing pinned yet) recomputes every block.
            expected = pinned or [Mode.RECOMPUTE] * len(blocks)
            assert modes == expected, f"step {step}: modes {modes} in force, pinned {expected}"
            rerun = counter.take()
            for i, mode in enumerate(expected):
                if mode != Mode.STORE and mode != Mode.OFFLOAD:
                    assert rerun[i] > 0, f"step {step}: {h.blocks[i]} ({mode.name}) was not recomputed"
                else:
                    assert rerun[i] == 0, f"step {step}: {h.blocks[i]} ({mode.name}) ran again in backward"
            for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
                if p.grad is None:
                    assert q.grad is None, f"step {step}: {name} has a gradient only under rematd"
                    continue
                assert q.grad is not None and same(p.grad, q.grad, exact), f"step {step} ({pinned}): grad of {name}"
                assert same(p, q, exact), f"step {step} ({pinned}): parameter {name}"
            for (name, b), c in zip(ref.named_buffers(), model.buffers(), strict=True):
                assert same(b, c, exact), f"step {step} ({pinned}): buffer {name}"
            opt_ref.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
            h.step()
        hello = introspect.hello(h)
        offered = {mc.mode for mc in hello.blocks[0].modes}
        assert (Mode.OFFLOAD in offered) == (device == "cuda"), f"offload offered: {offered} on {device}"
    finally:
        counter.remove()
        h.close()
    return h
