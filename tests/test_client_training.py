"""Training loops as users write them: accumulation, dropout, many plan switches; bitwise against no rematd."""

from __future__ import annotations

import itertools

import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.client.demo.tiny_gpt import lm_loss
from rematd.planner import Mode

from .helpers import batch, tiny_model, train_step


def test_plans_never_switch_between_micro_batches_of_one_step() -> None:
    model = tiny_model(n_layer=4, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=10**12)
    modes: list[tuple[int, int, tuple[bool, ...]]] = []  # (step, micro-batch, checkpointed per block)
    micro = 0
    switchable = introspect.blocks(h)

    def spy(module: torch.nn.Module, args: object) -> None:
        if module is switchable[0].module:
            modes.append((h.step_count, micro, tuple(b.checkpointed for b in switchable)))

    spies = [b.module.register_forward_pre_hook(spy) for b in switchable]
    n = len(h.blocks)
    for step in range(6):
        for micro in range(4):
            # New modes come in the middle of the step, as a plan from the service can: they wait for the next.
            if step >= 1 and micro == 1:
                blocks = range(0, n, 1 + step % 2)
                h.pin_modes([Mode.RECOMPUTE if i in blocks else Mode.STORE for i in range(n)])
            lm_loss(model, batch(16, seed=micro)).backward()
        opt.step()  # the hook ends the step
        opt.zero_grad()
    for s in range(6):
        per_step = {m for (st, _, m) in modes if st == s}
        assert len(per_step) == 1, f"step {s} switched between micro-batches: {per_step}"
    # The modes given mid-step were applied at the first forward of the next step.
    for s in range(2, 6):
        (m,) = {m for (st, _, m) in modes if st == s}
        assert m == tuple(i in range(0, n, 1 + (s - 1) % 2) for i in range(n)), (s, m)
    for sp in spies:
        sp.remove()
    h.close()


def test_hundred_steps_with_dropout_and_switches_match_a_run_without_rematd_bitwise() -> None:
    ref = tiny_model(n_layer=4, d_model=16, dropout=0.1, seed=5)
    model = tiny_model(n_layer=4, d_model=16, dropout=0.1, seed=5)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Planned on the training thread: a new budget's plan runs at the very next step, whatever the machine's load.
    h = client.attach(model, optimizer=opt, budget_bytes=10**12, planner_thread=False)
    free_peak = 0
    ran: list[tuple[Mode, ...]] = []
    for step in range(100):
        seq = 32 if (step // 7) % 2 else 16
        if step == 1:
            assert h.last_stats is not None
            free_peak = h.last_stats.saved_peak_bytes
        if step >= 1:
            # Alternate between a budget with room to spare and one that needs recomputation.
            h.budget_bytes = free_peak * 8 if (step // 15) % 2 else int(free_peak * 0.7)
        data = batch(seq, seed=step)
        losses = []
        for m, o in ((ref, opt_ref), (model, opt)):
            torch.manual_seed(1000 + step)  # the same dropout masks, if nothing disturbs the generator
            loss = lm_loss(m, data)
            loss.backward()
            losses.append(loss.detach())
            if step % 10 == 0 or step == 99:
                grads = [p.grad for p in m.parameters()]
                if m is ref:
                    ref_grads = grads
                else:
                    for (name, _), a, b in zip(ref.named_parameters(), ref_grads, grads, strict=True):
                        assert a is not None and b is not None and torch.equal(a, b), (step, name)
            o.step()
            o.zero_grad(set_to_none=True)
        assert torch.equal(losses[0], losses[1]), f"step {step}: {losses[0].item()} != {losses[1].item()}"
        ran.append(tuple(h.modes))
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    # The switches that ran (which modes the tight budget's plans use follows this machine's step times).
    switches = sum(a != b for a, b in itertools.pairwise(ran[1:]))
    assert len(h.history) >= 6 and switches >= 6, (switches, [(p.version, p.modes) for p in h.history])
    assert any(set(r) == {Mode.STORE} for r in ran[1:]) and any(set(r) != {Mode.STORE} for r in ran[1:]), ran
    h.close()


def test_compiled_models_are_refused_with_what_to_do_instead() -> None:
    model = tiny_model(n_layer=2, d_model=16)
    compiled = torch.compile(model)  # wrapping only; nothing compiles until it runs
    with pytest.raises(client.UnsupportedModel, match=r"torch\.compile"):
        client.attach(compiled)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        client.attach("model")  # type: ignore[arg-type]


def test_the_first_step_far_past_the_lengths_seen_keeps_to_the_budget() -> None:
    """Trained at 16 tokens (the table reaches 4 times that), then a step of 256: it runs every block
    recomputed and keeps to a budget that storing every block at 256 would cross; the plan after it is
    the planner's own for that length."""
    probe = tiny_model()
    opt = torch.optim.SGD(probe.parameters(), lr=0.01)
    h = client.attach(probe, budget_bytes=2**40, optimizer=opt)
    saved = {}
    for mode in (Mode.STORE, Mode.RECOMPUTE):
        h.pin_modes(mode)
        for seed in range(2):
            train_step(probe, opt, 256, seed)
        assert h.last_memory is not None
        saved[mode] = h.last_memory.saved_peak_bytes
    h.close()
    budget = saved[Mode.RECOMPUTE] + 3 * (saved[Mode.STORE] - saved[Mode.RECOMPUTE]) // 4

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, budget_bytes=budget, optimizer=opt)
    for seed in range(6):
        train_step(model, opt, 16, seed)
    assert h.plan.shape_plans and max(e.max_seq_len for e in h.plan.shape_plans) < 256
    train_step(model, opt, 256, 6)
    assert h.modes == (Mode.RECOMPUTE,) * 4
    assert h.last_memory is not None and h.last_memory.saved_peak_bytes <= budget
    for seed in (7, 8):
        train_step(model, opt, 256, seed)
        assert h.last_memory.saved_peak_bytes <= budget
    assert any(e.max_seq_len >= 256 for e in h.plan.shape_plans), "the planner extended its table past the step"
    assert h.modes != (Mode.RECOMPUTE,) * 4, "then the planner's own plan for that length runs"
    h.close()
