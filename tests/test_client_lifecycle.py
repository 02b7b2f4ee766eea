"""The handle's lifecycle on its own: each phase's transitions, and what is refused."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from rematd import client
from rematd.client.demo.tiny_gpt import lm_loss
from rematd.client.steps.phases import TRANSITIONS, Event, IllegalTransition, Lifecycle, Phase

from .helpers import batch, tiny_model


def test_profiling_then_planned() -> None:
    life = Lifecycle()
    assert (life.phase, life.has_profile, life.in_step, life.safe) == (Phase.PROFILING, False, False, False)
    assert life.begin_step() is Phase.PROFILING and life.in_step
    life.profiled()
    life.end_step()
    assert (life.phase, life.has_profile, life.in_step) == (Phase.PLANNED, True, False)
    assert life.begin_step() is Phase.PLANNED
    life.plan_applied()
    life.end_step()
    assert life.phase is Phase.PLANNED and not life.safe


def test_an_error_leads_to_the_retry_then_safe_mode_until_a_plan_is_applied() -> None:
    life = Lifecycle()
    life.begin_step()
    life.profiled()
    life.end_step()
    life.begin_step()
    life.oom()
    assert (life.phase, life.in_step, life.safe) == (Phase.RETRY, False, True)
    assert life.begin_step() is Phase.RETRY, "the step after the error is the retry"
    assert life.phase is Phase.SAFE and life.safe
    life.end_step()
    assert life.begin_step() is Phase.SAFE, "safe mode holds after the retry"
    life.end_step()
    life.begin_step()
    life.plan_applied()
    assert life.phase is Phase.PLANNED and not life.safe


def test_an_error_in_the_profiling_step_keeps_safe_mode_when_the_profile_completes() -> None:
    life = Lifecycle()
    life.begin_step()
    life.oom()
    assert life.phase is Phase.RETRY and not life.has_profile
    assert life.begin_step() is Phase.RETRY
    life.profiled()  # the profile completes from the blocks measured before the error
    life.end_step()
    assert (life.phase, life.has_profile) == (Phase.SAFE, True), "a profile alone does not end safe mode"
    life.begin_step()
    life.oom()
    life.oom()  # a second error before the retry began
    assert life.phase is Phase.RETRY


def test_close_is_final_and_idempotent() -> None:
    life = Lifecycle()
    life.begin_step()
    assert life.close() and life.closed and not life.in_step
    assert not life.close(), "closing twice is harmless"
    life.oom()  # the training job's own error after detaching
    assert life.closed
    with pytest.raises(IllegalTransition, match="begin_step is not allowed while closed"):
        life.begin_step()
    assert life.closed and not life.in_step


@pytest.mark.parametrize(
    ("phase", "event"),
    [(p, e) for p, e in itertools.product(Phase, Event) if (p, e) not in TRANSITIONS],
    ids=lambda x: x.value,
)
def test_every_transition_the_table_lacks_is_refused_and_changes_nothing(phase: Phase, event: Event) -> None:
    life = Lifecycle()
    life.phase = phase
    life.in_step = event is Event.END_STEP  # past the step checks: the table decides
    before = (life.phase, life.in_step, life.has_profile)
    with pytest.raises(ValueError, match=f"{event.value} is not allowed while {phase.value}"):
        getattr(life, event.value)()
    assert (life.phase, life.in_step, life.has_profile) == before


def test_step_boundaries_and_the_profile_are_checked() -> None:
    life = Lifecycle()
    with pytest.raises(IllegalTransition, match="end_step without a running step"):
        life.end_step()
    life.begin_step()
    with pytest.raises(IllegalTransition, match="begin_step while a step is running"):
        life.begin_step()
    life.profiled()
    with pytest.raises(IllegalTransition, match="profiled twice"):
        life.profiled()
    assert (life.phase, life.in_step) == (Phase.PLANNED, True)
    assert "planned, profiled, in step" in repr(life)


@pytest.mark.allow_client_errors(reason="the test forces an illegal transition, which the handle logs")
def test_an_illegal_transition_inside_the_handle_is_logged_and_training_goes_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(n_layer=2, d_model=32, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = client.attach(model, optimizer=opt, budget_bytes=10**12)
    lm_loss(model, batch(16)).backward()
    opt.step()
    assert h.step_count == 1
    ended = Lifecycle.end_step

    def end_then_fail(life: Lifecycle) -> None:
        # A fault no event leads to: the step ends, then the lifecycle refuses a transition.
        ended(life)
        raise IllegalTransition("rematd lifecycle: a transition refused after the step ended")

    monkeypatch.setattr(Lifecycle, "end_step", end_then_fail)
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.ERROR, logger="rematd.client"):
        for seed in (1, 2):
            opt.zero_grad()
            lm_loss(model, batch(16, seed=seed)).backward()
            opt.step()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and all("step bookkeeping failed" in r.getMessage() for r in errors)
    assert all(isinstance(r.exc_info[1], IllegalTransition) for r in errors if r.exc_info)
    assert any(not torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True)), "training went on"
    assert h.step_count == 3, "each step still ended"
    h.close()


def test_a_planned_step_skips_the_table_only_because_the_table_keeps_it_planned() -> None:
    """A planned step's start and end leave the phase as it is without a look at the table (they run every
    step, on the training thread): that holds only while the table says so."""
    assert TRANSITIONS[(Phase.PLANNED, Event.BEGIN_STEP)] is Phase.PLANNED
    assert TRANSITIONS[(Phase.PLANNED, Event.END_STEP)] is Phase.PLANNED
    life = Lifecycle()
    life.profiled()
    for _ in range(3):
        assert life.begin_step() is Phase.PLANNED and life.in_step
        life.end_step()
        assert life.phase is Phase.PLANNED and not life.in_step
