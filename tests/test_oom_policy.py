"""The out-of-memory policy on its own: counting, the retry, when an error is raised; and that the handle's
run_step and guard share it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.client.demo.tiny_gpt import lm_loss
from rematd.client.steps.oom import OomPolicy, is_oom, oom_message

from .helpers import batch, tiny_model


def policy(**kw: int) -> tuple[OomPolicy, list[BaseException]]:
    recovered: list[BaseException] = []
    return OomPolicy(recovered.append, **kw), recovered


def failing(times: int, error: Callable[[], BaseException] = lambda: torch.OutOfMemoryError("CUDA out of memory")):
    calls = [0]

    def fn(x: int) -> int:
        calls[0] += 1
        if calls[0] <= times:
            raise error()
        return x * 2

    return fn, calls


def test_errors_that_count_as_out_of_memory() -> None:
    assert is_oom(torch.OutOfMemoryError("x")) and is_oom(client.OutOfMemory("hard limit"))
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))
    assert oom_message(RuntimeError("x" * 900)) == "RuntimeError: " + "x" * 500


def test_run_retries_once_and_a_completed_step_ends_the_streak() -> None:
    p, recovered = policy()
    fn, calls = failing(1)
    assert p.run(fn, 21) == 42 and calls[0] == 2
    assert (p.count, p.streak, len(recovered)) == (1, 0, 1)
    assert isinstance(recovered[0], torch.OutOfMemoryError), "the recovery gets the error"
    assert p.run(lambda: 7) == 7 and p.count == 1


def test_run_raises_when_the_retry_fails_too() -> None:
    p, recovered = policy()
    fn, calls = failing(5)
    with pytest.raises(torch.OutOfMemoryError):
        p.run(fn, 1)
    assert (calls[0], p.count, p.streak, len(recovered)) == (2, 2, 2, 2)


def test_run_passes_other_errors_through_untouched() -> None:
    p, recovered = policy()
    fn, calls = failing(1, lambda: KeyError("batch"))
    with pytest.raises(KeyError):
        p.run(fn, 1)
    assert (calls[0], p.count, p.streak, recovered) == (1, 0, 0, [])


def test_a_guarded_error_is_suppressed_unless_it_is_the_second_in_a_row() -> None:
    p, recovered = policy()
    oom = torch.OutOfMemoryError("CUDA out of memory")
    assert p.after_guarded(oom) and p.streak == 1
    assert not p.after_guarded(oom), "the guarded retry failed too: raised"
    assert (p.count, p.streak, len(recovered)) == (2, 2, 2)
    assert not p.after_guarded(None) and p.streak == 0
    assert p.after_guarded(oom), "a new streak"
    assert not p.after_guarded(ZeroDivisionError()) and not p.after_guarded(KeyboardInterrupt())
    assert p.count == 3, "only out-of-memory errors count"


def test_give_up_after_sets_the_tries_and_the_streak_and_is_checked() -> None:
    p, _ = policy(give_up_after=3)
    fn, calls = failing(2)
    assert p.run(fn, 2) == 4 and calls[0] == 3
    oom = RuntimeError("CUDA error: out of memory")
    assert p.after_guarded(oom) and p.after_guarded(oom) and not p.after_guarded(oom)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="give_up_after must be an integer >= 1"):
            OomPolicy(lambda exc: None, give_up_after=bad)  # type: ignore[arg-type]


def test_run_step_and_guard_share_the_handles_policy() -> None:
    model = tiny_model(n_layer=2, d_model=32, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    h = client.attach(model, optimizer=opt, budget_bytes=10**12, hard_limit_bytes=10_000)

    def step() -> None:
        lm_loss(model, batch(64)).backward()
        opt.step()
        opt.zero_grad()

    with h.guard() as g:
        step()  # does not fit, even with every block recomputed
    assert g.oom and h.oom_policy.streak == 1 and h.oom_count == 1 and h.safe_mode
    with pytest.raises(client.OutOfMemory):
        h.run_step(step)
    assert h.oom_count == 3 and h.oom_policy.count == 3 and h.oom_policy.streak == 3
    h.hard_limit_bytes = None
    h.run_step(step)
    assert h.oom_policy.streak == 0 and h.oom_count == 3
    h.close()


def test_after_close_an_out_of_memory_error_is_the_training_jobs_own() -> None:
    model = tiny_model(n_layer=2, d_model=32, seed=6)
    h = client.attach(model, budget_bytes=10**12)
    h.close()

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError), h.guard():
        oom()
    with pytest.raises(torch.OutOfMemoryError):
        h.run_step(oom)
    assert h.oom_count == 0 and h.oom_policy.count == 0, "nothing recovered, nothing retried"


@pytest.mark.allow_client_errors(reason="the in-process planner is made to fail on the OOM report")
def test_a_planner_failing_on_the_oom_report_still_leaves_safe_mode_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    from rematd.planner.session import PlannerSession

    def broken(self: PlannerSession, *args: object, **kwargs: object) -> None:
        raise RuntimeError("planner broke on the OOM report")

    monkeypatch.setattr(PlannerSession, "report_oom", broken)
    model = tiny_model(n_layer=2, d_model=32, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    h = client.attach(model, optimizer=opt, budget_bytes=10**12)

    def step() -> None:
        lm_loss(model, batch(16)).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # profiled, planned
        h.run_step(step)
    h.hard_limit_bytes = 10_000
    with h.guard() as g:
        step()
    assert g.oom and h.safe_mode, "the plan that ran out of memory is not left in force"
    assert all(b.checkpointed for b in introspect.blocks(h))
    h.hard_limit_bytes = None
    h.run_step(step)
    h.close()
