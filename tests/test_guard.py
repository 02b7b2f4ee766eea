"""Out-of-memory recovery, by injection on the CPU: the hard limit on bytes saved for backward."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.client.demo.tiny_gpt import lm_loss
from rematd.planner import Mode

from .helpers import batch, live_server, tiny_model

HUGE = 10**12
# At seq 64 the tiny model saves about 1.37 MB storing every block and 0.55 MB recomputing every block (the
# loss head's share is most of it); at seq 16, 0.29 MB storing. After an error at 64 the planner caps that
# length a tenth of the way from its leanest plan's predicted peak to the failed plan's, and the plans under
# the cap measure up to about 0.71 MB (their prediction at a length not profiled is off by up to a fifth
# either way): the limit lets every one of them through, and stops only storing every block at 64.
LIMIT = 800_000


def make(**kw: object) -> tuple[torch.nn.Module, torch.optim.Optimizer, client.Handle]:
    model = tiny_model(n_layer=4, d_model=32, seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # Planned on the training thread: the storing plan that runs out of memory is in force at the step after
    # the profile, whatever the machine's load.
    if "server" not in kw:
        kw["planner_thread"] = False
    h = client.attach(model, optimizer=opt, **kw)  # type: ignore[arg-type]
    return model, opt, h


def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer, seq: int, seed: int) -> float:
    loss = lm_loss(model, batch(seq, seed=seed))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def test_run_step_recovers_once_retries_with_every_block_recomputed_and_trains_the_same(tmp_path: Path) -> None:
    ref, ref_opt, _ = make()
    _.close()
    with live_server(tmp_path) as srv:
        model, opt, h = make(budget_bytes=HUGE, hard_limit_bytes=LIMIT, server=srv.grpc, job="oom-job")
        seqs = [16, 16, 64, 64, 64, 16]
        for i, seq in enumerate(seqs):
            expected = step_fn(ref, ref_opt, seq, i)
            got = h.run_step(step_fn, model, opt, seq, i)
            assert got == expected, f"step {i}: the retried step computes what a clean step does"
            assert h.flush(20.0)
            if i == 2:
                assert h.oom_count == 1 and h.safe_mode, "the retry ran with every block recomputed"
        assert h.oom_count == 1, "after the first error the planner's tighter plan held"
        # The planner's plan (made for the length that ran out of memory; the last step, short, stores).
        tighter = h.history[-1]
        assert not h.safe_mode and tighter.blocks, f"a tighter plan from the planner replaced safe mode: {tighter}"
        for p, q in zip(ref.parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q)
        ooms = httpx.get(f"{srv.url}/api/v1/jobs/oom-job/ooms", timeout=10).json()
        ooms = ooms["ooms"] if isinstance(ooms, dict) else ooms
        assert len(ooms) == 1 and ooms[0]["seq_len"] == 64 and ooms[0]["step"] == 2
        assert "hard_limit_bytes" in ooms[0]["message"]
        h.close()


def test_a_second_error_in_a_row_is_raised() -> None:
    model, opt, h = make(budget_bytes=HUGE)
    h.run_step(step_fn, model, opt, 8, 0)
    h.hard_limit_bytes = 50_000
    with pytest.raises(client.OutOfMemory):
        h.run_step(step_fn, model, opt, 64, 1)  # does not fit even with every block recomputed
    assert h.oom_count == 2
    assert all(p.grad is None for p in model.parameters()), "the failed step's gradients were dropped"
    assert introspect.accounting(h).live_bytes == 0, "the failed step's graph was freed"
    h.close()


def test_guard_suppresses_the_first_error_and_raises_the_second() -> None:
    model, opt, h = make(budget_bytes=HUGE, hard_limit_bytes=LIMIT)
    with h.guard() as g:
        step_fn(model, opt, 16, 0)
    assert not g.oom
    with h.guard() as g:
        step_fn(model, opt, 64, 1)
    assert g.oom and h.safe_mode
    with h.guard() as g:  # the retry fits with every block recomputed
        step_fn(model, opt, 64, 1)
    assert not g.oom
    h.hard_limit_bytes = 10_000
    with h.guard() as g:
        step_fn(model, opt, 64, 2)
    assert g.oom
    with pytest.raises(torch.OutOfMemoryError), h.guard():
        step_fn(model, opt, 64, 2)
    with pytest.raises(ZeroDivisionError), h.guard():
        _ = 1 / 0
    h.close()


def test_an_error_in_the_profiling_step_still_leads_to_a_plan() -> None:
    model, opt, h = make(budget_bytes=HUGE)
    left = [1]

    def out_of_memory(*_: object) -> None:
        # The device runs out in the third block's first forward: two blocks were profiled, two were not.
        if left[0]:
            left[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    injected = model.h[2].register_forward_pre_hook(out_of_memory)
    h.run_step(step_fn, model, opt, 16, 0)
    injected.remove()
    assert h.oom_count == 1
    # Safe mode: the blocks not profiled borrow the largest profile, and every block recomputes meanwhile.
    assert h.modes == (Mode.RECOMPUTE,) * 4
    for i in range(1, 4):
        h.run_step(step_fn, model, opt, 16, i)
    assert h.plan.version >= 1 and h.plan.blocks, "the planner got a profile and the error, and checkpoints"
    assert h.oom_count <= 2
    h.close()
