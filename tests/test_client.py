from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from rematd import client
from rematd.client.demo.tiny_gpt import lm_loss
from rematd.client.memory.accounting import SavedTensorAccounting, storage_id
from rematd.planner import Mode

from .helpers import batch, tiny_model, train_step

MiB = 2**20


def test_finds_the_block_list_and_names_it() -> None:
    model = tiny_model(n_layer=3)
    h = client.attach(model)
    assert h.blocks == ["h.0", "h.1", "h.2"]
    assert h.plan.version == 0 and h.plan.blocks == ()
    h.close()


def test_discovery_errors_say_what_to_do() -> None:
    with pytest.raises(client.BlockDiscoveryError, match="blocks="):
        client.attach(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))

    class Twin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            self.b = nn.ModuleList(nn.ReLU() for _ in range(3))

    with pytest.raises(client.BlockDiscoveryError, match="equally long"):
        client.attach(Twin())
    model = tiny_model()
    with pytest.raises(client.BlockDiscoveryError, match="not a submodule"):
        client.attach(model, blocks=[nn.Linear(1, 1)])
    with pytest.raises(client.BlockDiscoveryError, match="twice"):
        client.attach(model, blocks=[model.h[0], model.h[0]])
    with pytest.raises(ValueError, match="budget_bytes"):
        client.attach(model, budget_bytes=-5)


def test_explicit_blocks_and_state_dict_untouched() -> None:
    model = tiny_model()
    keys = list(model.state_dict())
    h = client.attach(model, blocks=[model.h[1], model.h[3]])
    assert h.blocks == ["h.1", "h.3"]
    assert list(model.state_dict()) == keys
    h.close()
    assert "forward" not in model.h[1].__dict__


def _forward_flops(model: nn.Module, seq: int) -> int:
    with FlopCounterMode(display=False) as counter:
        lm_loss(model, batch(seq)).backward()
    return int(counter.get_total_flops())


def test_plans_change_recompute_and_memory() -> None:
    model = tiny_model(n_layer=4, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # Planned on the training thread: each plan is in force at the step after the one it answers.
    h = client.attach(model, optimizer=opt, budget_bytes=10**12, planner_thread=False)
    train_step(model, opt, 64)
    assert h.last_stats is not None
    lean_peak = h.last_stats.saved_peak_bytes
    assert h.plan.version == 0  # the plan from the profile is applied at the next forward
    flops_free = _forward_flops(model, 64)
    assert h.plan.blocks == (), "a huge budget needs no checkpointing"
    opt.zero_grad()
    h.step()
    assert h.last_stats is not None
    free_peak = h.last_stats.saved_peak_bytes
    assert free_peak > 2 * lean_peak > 0, "the profiling step recomputed every block; the next stored them"
    # Squeeze the budget: the next plan recomputes, measurably.
    h.budget_bytes = int(free_peak * 0.6)
    train_step(model, opt, 64)
    assert h.plan.version >= 1
    train_step(model, opt, 64)
    assert h.plan.blocks, "a budget below the no-checkpoint peak must checkpoint"
    # The cut tightened the plan (a trial of an untried mode may follow it within the new budget).
    assert any("tighten" in p.reason for p in h.history), [p.reason for p in h.history]
    assert h.last_stats.saved_peak_bytes < free_peak
    assert h.last_stats.saved_peak_bytes <= h.budget_bytes
    flops_ckpt = _forward_flops(model, 64)
    opt.zero_grad()
    h.step()
    assert flops_ckpt > flops_free, "checkpointed blocks run their forward again in backward"
    h.close()


def test_gradients_equal_with_and_without_checkpointing() -> None:
    ref = tiny_model(dropout=0.1, seed=1)
    model = tiny_model(dropout=0.1, seed=1)
    h = client.attach(model, budget_bytes=10**12)
    lm_loss(model, batch(48)).backward()  # the profiling step: every block stores
    h.step()
    model.zero_grad(set_to_none=True)
    h.pin_modes(["recompute" if i % 2 == 0 else "store" for i in range(len(h.blocks))])
    for m in (ref, model):
        torch.manual_seed(7)
        lm_loss(m, batch(48)).backward()
    assert h.modes[:2] == (Mode.RECOMPUTE, Mode.STORE), "the pinned step recomputed every other block"
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad), name
    h.close()


def test_accounting_frees_what_backward_releases() -> None:
    acct = SavedTensorAccounting()
    x = torch.randn(64, 64, requires_grad=True)
    with acct.hooks():
        y = (x * x).sin().sum()
    assert acct.live_bytes >= 64 * 64 * 4
    y.backward()
    del y
    assert acct.live_bytes == 0
    assert acct.take_peak() >= 64 * 64 * 4


def test_an_activation_at_a_gathered_parameters_old_address_is_counted() -> None:
    """A sharded set-up frees the storage it gathers a parameter into between uses; the allocator may then give
    its address to an activation. Two storages over one buffer stand for that: the same address, another storage."""
    memory = bytearray(64 * 64 * 4)
    model = nn.Linear(64, 64, bias=False)
    model.weight = nn.Parameter(torch.frombuffer(memory, dtype=torch.float32).view(64, 64))
    activation = torch.frombuffer(memory, dtype=torch.float32).view(64, 64)
    assert activation.data_ptr() == model.weight.data_ptr()

    plain = SavedTensorAccounting()
    plain.exclude_module_state(model)
    held = plain.pack(model.weight)
    assert plain.live_bytes == 0, "a parameter is no activation"

    sharded = SavedTensorAccounting()
    gathered = frozenset({storage_id(model.weight)})
    sharded.exclude_module_state(model, gathered)
    sharded.gathered = gathered
    held = [sharded.pack(model.weight), sharded.pack(activation)]
    assert sharded.live_bytes == 64 * 64 * 4, "the gathered weight is not counted, the activation at its address is"
    del held
    assert sharded.live_bytes == 0


def test_step_without_forward_is_harmless_and_close_is_idempotent() -> None:
    model = tiny_model()
    h = client.attach(model)
    h.step()
    assert h.step_count == 0
    h.close()
    h.close()
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), 16)


def test_no_grad_forward_is_ignored() -> None:
    model = tiny_model()
    h = client.attach(model)
    with torch.no_grad():
        model(batch(16)[:, :-1])
    h.step()
    assert h.step_count == 0
    h.close()
