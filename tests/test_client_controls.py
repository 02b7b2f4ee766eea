"""What a training loop changes by hand between steps: pinned modes and the budget (real CPU training steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.client.plans.background import ThreadedBackend
from rematd.planner import Mode

from .helpers import live_server, tiny_model, train_step


def _attached(budget: int = 10**12, n_layer: int = 4, *, planner_thread: bool = False):  # type: ignore[no-untyped-def]
    """A model and its handle; planned on the training thread unless ``planner_thread``: each control's effect is
    then in force at the very step after it, whatever the machine's load."""
    model = tiny_model(n_layer=n_layer, d_model=32, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, client.attach(model, optimizer=opt, budget_bytes=budget, planner_thread=planner_thread)


def test_one_mode_pins_every_block_and_a_list_pins_each() -> None:
    model, opt, h = _attached()
    train_step(model, opt, 32)
    h.pin_modes("recompute")
    train_step(model, opt, 32, seed=1)
    assert h.modes == (Mode.RECOMPUTE,) * 4
    assert all(b.checkpointed for b in introspect.blocks(h)), "the blocks really recompute"
    h.pin_modes(Mode.SELECTIVE)
    train_step(model, opt, 32, seed=2)
    assert h.modes == (Mode.SELECTIVE,) * 4
    h.pin_modes(["store", "recompute", Mode.STORE, "Recompute"])
    train_step(model, opt, 32, seed=3)
    assert h.modes == (Mode.STORE, Mode.RECOMPUTE, Mode.STORE, Mode.RECOMPUTE)
    h.pin_modes("R.a.")  # as plans are printed
    train_step(model, opt, 32, seed=4)
    assert h.modes == (Mode.RECOMPUTE, Mode.STORE, Mode.ATTENTION, Mode.STORE)
    h.pin_modes(None)
    train_step(model, opt, 32, seed=4)
    assert h.modes == h.plan.modes_for(h.last_shape, 4), "unpinned, the plan's modes again"
    h.close()


def test_a_bad_pin_names_what_was_wrong_and_changes_nothing() -> None:
    model, opt, h = _attached()
    train_step(model, opt, 32)
    h.pin_modes("recompute")
    with pytest.raises(ValueError, match=r"^pin_modes: unknown mode 'everything'"):
        h.pin_modes("everything")
    with pytest.raises(TypeError, match=r"^pin_modes takes a mode for every block or a list of modes.*float 3\.5"):
        h.pin_modes(3.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^pin_modes takes a mode for every block"):
        h.pin_modes(b"recompute")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^pin_modes needs 4 modes, one per block, got 2"):
        h.pin_modes(["store", "store"])
    with pytest.raises(ValueError, match=r"^pin_modes: 'RR\.' has 3 letters, one per block; the model has 4"):
        h.pin_modes("RR.")
    with pytest.raises(ValueError, match=r"^pin_modes: unknown mode 'RRxR'.*one letter a block of '\.sROCtam'"):
        h.pin_modes("RRxR")
    train_step(model, opt, 32, seed=1)
    assert h.modes == (Mode.RECOMPUTE,) * 4, "the pin in force before the bad ones stays"
    h.close()


def test_a_pin_before_the_first_step_applies_from_the_first_step_after_profiling() -> None:
    model, opt, h = _attached()
    h.pin_modes("recompute")
    train_step(model, opt, 32)
    assert h.step_count == 1 and not h.history, "the profiling step: no plan of the planner's applied yet"
    assert h.plan.modes == (Mode.RECOMPUTE,) * 4 and "pinned" in h.plan.reason, "the pin is the plan in force"
    profiled = h.last_stats
    assert profiled is not None and profiled.modes == (Mode.RECOMPUTE,) * 4, "profiling recomputes every block"
    h.pin_modes("store")
    train_step(model, opt, 32, seed=1)
    assert h.modes == (Mode.STORE,) * 4
    pinned = h.last_stats
    assert pinned is not None and pinned.saved_peak_bytes > 2 * profiled.saved_peak_bytes
    h.close()


def test_a_budget_change_applies_to_the_very_next_step() -> None:
    model, opt, h = _attached()
    for step in range(3):
        train_step(model, opt, 64, seed=step)
    assert h.last_stats is not None and h.plan.blocks == ()
    free_peak = h.last_stats.saved_peak_bytes
    before = h.plan.version
    # Between steps, as a training loop would.
    h.budget_bytes = int(free_peak * 0.6)
    train_step(model, opt, 64, seed=3)
    assert h.plan.version > before, "the next step ran a plan made for the new budget"
    assert h.plan.target_bytes <= h.budget_bytes
    assert h.plan.modes_for(h.last_shape, 4) == h.modes and any(m != Mode.STORE for m in h.modes)
    assert h.last_stats.saved_peak_bytes <= h.budget_bytes, "measured within the new budget at once"
    # Back up: the budget is there again; the planner loosens after its dwell, never tightens.
    h.budget_bytes = free_peak * 4
    for step in range(4, 30):
        train_step(model, opt, 64, seed=step)
    assert h.modes == (Mode.STORE,) * 4
    h.close()


def test_with_the_planner_on_its_thread_a_budget_cut_holds_the_next_step_within_it() -> None:
    """The planner's thread answers a cut when it can; until its plan is in, the steps keep the least they can."""
    model, opt, h = _attached(planner_thread=True)
    for step in range(3):
        train_step(model, opt, 64, seed=step)
        assert h.flush(10.0)
    train_step(model, opt, 64, seed=3)  # the plan that stores everything is in force
    assert h.last_stats is not None and h.plan.blocks == ()
    free_peak = h.last_stats.saved_peak_bytes
    # The planner is busy (as with a long search): the cut reaches it only after the next step.
    backend = introspect.backend(h)
    assert isinstance(backend, ThreadedBackend)
    with introspect.planning_lock(backend):
        h.budget_bytes = int(free_peak * 0.6)
        train_step(model, opt, 64, seed=4)
        assert h.modes == (Mode.RECOMPUTE,) * 4, "every block at its leanest until the planner has taken the cut in"
        assert "budget was cut" in h.plan.reason
        assert h.last_stats.saved_peak_bytes <= h.budget_bytes
    assert h.flush(10.0)
    train_step(model, opt, 64, seed=5)
    assert h.plan.target_bytes <= h.budget_bytes and h.plan.modes == h.modes, "the plan made for the cut"
    assert h.last_stats.saved_peak_bytes <= h.budget_bytes
    h.close()


def test_the_same_budget_again_makes_no_plan() -> None:
    model, opt, h = _attached(budget=5_000_000)
    for step in range(3):
        train_step(model, opt, 64, seed=step)
    version = h.plan.version
    h.budget_bytes = 5_000_000
    train_step(model, opt, 64, seed=3)
    assert h.plan.version == version
    h.close()


def test_with_a_service_a_budget_cut_applies_to_the_very_next_step(tmp_path: Path) -> None:
    model = tiny_model(n_layer=4, d_model=32, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with live_server(tmp_path) as srv:
        h = client.attach(model, optimizer=opt, budget_bytes=10**12, server=srv.grpc, job="budget-cut")
        for step in range(3):
            train_step(model, opt, 64, seed=step)
            assert h.flush(20.0)
        assert h.last_stats is not None and h.plan.blocks == ()
        free_peak = h.last_stats.saved_peak_bytes
        version = h.plan.version
        h.budget_bytes = int(free_peak * 0.6)
        # The service has not heard of the cut yet: the next step runs every block at its leanest, and says so.
        train_step(model, opt, 64, seed=3)
        assert h.plan.version == version and h.modes == (Mode.RECOMPUTE,) * 4
        assert h.last_stats.saved_peak_bytes <= h.budget_bytes, "measured within the new budget at once"
        assert h.last_stats.modes == (Mode.RECOMPUTE,) * 4
        assert h.flush(20.0)
        # The service's plan for the new budget arrives and replaces the interim one.
        train_step(model, opt, 64, seed=4)
        assert h.plan.version > version and h.plan.target_bytes <= h.budget_bytes
        assert h.modes == h.plan.modes_for(h.last_shape, 4)
        assert h.last_stats.saved_peak_bytes <= h.budget_bytes
        # A raise leaves the plan in force alone: it fits.
        h.budget_bytes = free_peak * 4
        train_step(model, opt, 64, seed=5)
        assert h.modes == h.plan.modes_for(h.last_shape, 4)
        h.close()


def test_planning_in_process_far_over_the_budget_says_so_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    model, opt, h = _attached(budget=10_000)  # a few KiB: no plan fits
    with caplog.at_level("WARNING", logger="rematd.client"):
        for seed in range(4):
            train_step(model, opt, 32, seed=seed)
    said = [r.getMessage() for r in caplog.records]
    no_fit = [m for m in said if m.startswith("rematd: plan v1: ") and "no plan fits the budget of 9.8 KiB" in m]
    assert len(no_fit) == 1 and "no plan fits" in h.plan.reason, said  # once per plan, not once per step
    over = [m for m in said if "over the budget of 0.0 MiB" in m]
    # Every step over the budget, each once, naming the budget it crossed.
    assert [m.split(" peaked")[0] for m in over] == [f"rematd: step {k}" for k in range(4)], said
    h.close()
    caplog.clear()
    model, opt, h = _attached()  # room for everything: nothing to say
    with caplog.at_level("WARNING", logger="rematd.client"):
        for seed in range(3):
            train_step(model, opt, 32, seed=seed)
    assert caplog.records == []
    h.close()
