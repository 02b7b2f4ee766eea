"""Offload on a side stream: what the CPU can check of it (the copies, the prefetch before each block's
backward, the timing); the overlap itself needs CUDA (tests/test_cuda.py runs every mode there)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.client.blocks import offload
from rematd.planner import Mode

from .helpers import batch, lm_loss, tiny_model


def test_offloaded_blocks_train_exactly_as_stored_ones_and_come_back_before_their_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # tiny tensors: offload them all the same
    ref = tiny_model(dropout=0.2, seed=5)
    model = tiny_model(dropout=0.2, seed=5)
    h = client.attach(model, budget_bytes=10**12, modes=["store", "recompute", "offload"])
    assert Mode.OFFLOAD not in introspect.blocks(h)[0].offer, "no host link to measure on the CPU: not offered"
    lm_loss(model, batch(24)).backward()  # the profiling step
    h.step()
    model.zero_grad()
    h.pin_modes([Mode.OFFLOAD] * 4)  # as a plan naming offload would have it
    for seed in (1, 2):
        torch.manual_seed(seed)
        ref_loss = lm_loss(ref, batch(24, seed=seed))
        ref_loss.backward()
        torch.manual_seed(seed)
        loss = lm_loss(model, batch(24, seed=seed))
        loss.backward()
        h.step()
        assert loss.item() == ref_loss.item()
        for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), name
        ref.zero_grad()
        model.zero_grad()
    off = introspect.offloader(h)
    assert (off.prefetched, off.late) == (8, 0), "every block fetched when the gradient reached its output"
    assert introspect.offload_groups(off) == 0, "nothing left behind"
    assert h.last_stats is not None
    (timed,) = h.last_stats.mode_seconds
    assert timed.mode == Mode.OFFLOAD and timed.blocks == 4
    assert timed.forward_seconds > 0 and timed.seconds > 0, "the copies out and back are both timed"
    h.close()


def test_small_tensors_and_parameters_stay_on_the_device() -> None:
    off = offload.Offloader()
    w = torch.nn.Parameter(torch.randn(256, 256))
    x = torch.randn(4, 256, requires_grad=True)
    with off.block() as group:
        y = (x @ w).relu().sum()
    assert group.saved == [], "a parameter and tensors under 64 KiB are not worth a copy"
    y.backward()
    assert x.grad is not None and w.grad is not None


def test_groups_of_forwards_without_backward_go_at_the_step_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward with gradients on whose backward never runs leaves its host copies behind only until the
    step ends; a backward still pending then finds its own."""
    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    off = offload.Offloader()
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)

    def two_blocks() -> torch.Tensor:
        with off.block() as first:
            y = (x @ w).sin()
        off.on_output(first, y)
        with off.block() as second:
            z = (y @ w).cos()
        off.on_output(second, z)
        return z.sum()

    pending = two_blocks()
    with off.block() as unused:
        _ = (x @ w).sin().sum()  # evaluated, never backpropagated
    host = weakref.ref(unused.saved[0].host)
    del unused, _
    assert introspect.offload_groups(off) == 3
    off.end_step()
    gc.collect()
    assert introspect.offload_groups(off) == 0 and host() is None, "the unused forward's host copies are gone"
    pending.backward()  # the pending backward still has what it saved
    assert off.prefetched == 2 and off.late == 0
    grads = x.grad.clone(), w.grad.clone()  # type: ignore[union-attr]
    x.grad = w.grad = None
    ((x @ w).sin() @ w).cos().sum().backward()
    assert torch.allclose(grads[0], x.grad) and torch.allclose(grads[1], w.grad)  # type: ignore[arg-type]
