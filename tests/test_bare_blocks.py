"""Storing blocks run their own forward, nothing of rematd's around it, on the steps that neither time them nor
count saved tensors (on CUDA: every step but one in eight). Here on the CPU with the saved-tensor accounting off,
as on CUDA: the training is the plain model's, bit for bit; the blocks are wrapped again on the timed steps and
whenever their mode changes."""

from __future__ import annotations

import copy

import torch

from rematd import client
from rematd.client import introspect
from rematd.client.steps.modes_run import STORE_TIMED_EVERY
from rematd.planner import Mode

from .helpers import tiny_model, train_step


def _wrapped(h: client.Handle) -> list[bool]:
    return ["forward" in b.module.__dict__ for b in introspect.blocks(h)]


def test_storing_blocks_run_bare_between_timed_steps_and_train_as_the_plain_model() -> None:
    plain = tiny_model(n_layer=4, d_model=32)
    model = copy.deepcopy(plain)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=2**40)
    introspect.cycle(h).saved_hooks = False  # as on CUDA
    seen = []
    for step in range(3 * STORE_TIMED_EVERY):
        assert train_step(model, opt, 32, seed=step) == train_step(plain, plain_opt, 32, seed=step), step
        stats = h.last_stats
        assert stats is not None
        timed = {m.mode for m in stats.mode_seconds}
        seen.append((stats.step, h.modes, _wrapped(h), timed))
        if step == 1:
            assert h.flush(10.0)
    stored = [s for s in seen if s[0] > 1 and all(m is Mode.STORE for m in s[1])]
    assert len(stored) >= 2 * STORE_TIMED_EVERY, seen
    for step, _, wrapped, timed in stored:
        on_timed_step = step % STORE_TIMED_EVERY == 0
        assert wrapped == [on_timed_step] * 4, (step, wrapped)
        assert (Mode.STORE in timed) == on_timed_step, (step, timed)
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name

    # A change of mode wraps the block again from the next step: it recomputes, and is timed doing it.
    h.pin_modes([Mode.RECOMPUTE, Mode.STORE, Mode.STORE, Mode.STORE])
    for step in range(2):
        train_step(model, opt, 32, seed=100 + step)
        assert h.modes[0] is Mode.RECOMPUTE
        assert _wrapped(h)[0], "a recomputing block runs rematd's forward"
        stats = h.last_stats
        assert stats is not None
        (recomputed,) = [m for m in stats.mode_seconds if m.mode is Mode.RECOMPUTE]
        assert recomputed.blocks == 1 and recomputed.seconds > 0
    h.close()
    assert _wrapped(h) == [False] * 4, "closed: every block runs its own forward"


def test_with_saved_tensors_counted_every_block_stays_wrapped() -> None:
    model = tiny_model(n_layer=2, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with client.attach(model, optimizer=opt, budget_bytes=2**40) as h:
        for step in range(STORE_TIMED_EVERY + 2):
            train_step(model, opt, 32, seed=step)
            assert _wrapped(h) == [True, True], step
            stats = h.last_stats
            assert stats is not None and stats.saved_peak_bytes > 0


def test_a_block_class_with_its_own_setattr_sees_its_forward_swapped() -> None:
    """Blocks whose class keeps nn.Module's ``__setattr__`` have their forward swapped in their dict (the fast
    way); a class of its own ``__setattr__`` is sent each swap through it."""
    model = tiny_model(n_layer=2, d_model=32)
    block_class = type(model.h[0])
    swaps: list[object] = []

    class Watched(block_class):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: object) -> None:
            if name == "forward":
                swaps.append(value)
            super().__setattr__(name, value)

    for block in model.h:
        block.__class__ = Watched
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=2**40)
    introspect.cycle(h).saved_hooks = False  # as on CUDA: storing blocks run bare between timed steps
    before = len(swaps)
    for step in range(2 * STORE_TIMED_EVERY + 1):
        train_step(model, opt, 32, seed=step)
        if step == 1:
            assert h.flush(10.0)
    assert len(swaps) > before, "the swaps to and from running bare went through the class's __setattr__"
    stats = h.last_stats
    assert stats is not None
    on_timed_step = stats.step % STORE_TIMED_EVERY == 0
    assert _wrapped(h) == [on_timed_step] * 2, "wrapped on timed steps only, as with nn.Module's own __setattr__"
    h.close()
