"""The seam tests and tools look inside a handle through: it agrees with the handle's public view, and says
plainly when what is asked for does not exist yet (or here)."""

from __future__ import annotations

import pytest
import torch

from rematd import client
from rematd.client import introspect

from .helpers import tiny_model, train_step


def test_the_seam_agrees_with_the_handle_and_the_hello_exists_once_the_planner_opened() -> None:
    model = tiny_model(n_layer=3, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=10**12, planner_thread=False)
    with pytest.raises(LookupError, match="not open yet"):
        introspect.hello(h)
    assert introspect.session(h) is None, "no planner before the profiling step"
    train_step(model, opt, 16)
    assert [b.name for b in introspect.blocks(h)] == h.blocks
    assert tuple(b.mode for b in introspect.blocks(h)) == h.modes
    assert len(introspect.hello(h).blocks) == len(h.blocks), "the hello profiles every block"
    assert introspect.session(h) is not None, "the planner opened at the profiling step's end"
    assert introspect.cycle(h).step == h.step_count
    h.close()


def test_a_served_handle_has_no_planner_here_and_its_stream_thread_starts_at_the_first_step() -> None:
    model = tiny_model(n_layer=2, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, server="127.0.0.1:1", job="seam", fallback_after_s=None)
    stream = h.stream
    assert stream is not None and introspect.stream_thread(stream) is None, "nothing runs before the first step"
    with pytest.raises(TypeError, match="a service plans"):
        introspect.session(h)
    with pytest.raises(LookupError, match="not open yet"):
        introspect.hello(h)
    train_step(model, opt, 16)
    thread = introspect.stream_thread(stream)
    assert thread is not None and thread.is_alive(), "the stream keeps trying an unreachable service"
    assert introspect.hello(h).job_id == "seam"
    h.close(timeout=0.5)
    thread.join(5.0)
    assert not thread.is_alive(), "closing the handle ends its stream"
