"""Per-block modes on real CPU training steps: same gradients, predicted memory, recomputation."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rematd import client
from rematd.client import introspect
from rematd.client.blocks.profiling import BlockMeasure, alike_seconds
from rematd.client.demo.tiny_gpt import lm_loss
from rematd.planner import Mode, ModeCost, Shape, Size
from rematd.planner.cost import choose, peak_of

from .helpers import batch, tiny_model

ALL = [Mode.STORE, Mode.SELECTIVE, Mode.TITAN, Mode.ATTENTION, Mode.MLP, Mode.RECOMPUTE, Mode.OFFLOAD]


def step(model: torch.nn.Module, h: client.Handle, seq: int, seed: int) -> float:
    torch.manual_seed(seed)
    loss = lm_loss(model, batch(seq, seed=seed))
    loss.backward()
    h.step()
    return float(loss.item())


@pytest.mark.parametrize("mode", ALL, ids=lambda m: m.name.lower())
def test_gradients_bitwise_equal_under_every_mode(mode: Mode) -> None:
    ref = tiny_model(dropout=0.2, seed=5)
    model = tiny_model(dropout=0.2, seed=5)
    h = client.attach(model, budget_bytes=10**12)
    step(model, h, 24, 0)  # the profiling step
    model.zero_grad()
    h.pin_modes(mode)
    for seed in (1, 2):
        torch.manual_seed(seed)
        ref_loss = lm_loss(ref, batch(24, seed=seed))
        ref_loss.backward()
        loss = step(model, h, 24, seed)
        assert loss == ref_loss.item()
        for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert torch.equal(p.grad, q.grad), f"{mode.name}: {name}"
        ref.zero_grad()
        model.zero_grad()
    assert all(m == mode for m in h.modes)
    h.close()


@pytest.mark.parametrize("seq", [32, 80])
@pytest.mark.parametrize(
    "mode",
    [Mode.STORE, Mode.SELECTIVE, Mode.TITAN, Mode.ATTENTION, Mode.MLP, Mode.RECOMPUTE],
    ids=lambda m: m.name.lower(),
)
def test_measured_saved_bytes_match_the_prediction(mode: Mode, seq: int) -> None:
    model = tiny_model(n_layer=4, d_model=48, seed=2)
    h = client.attach(model, budget_bytes=10**12)
    step(model, h, 32, 0)  # profile at seq 32; seq 80 is predicted from the shape terms
    profile = introspect.hello(h).profile()
    h.pin_modes(mode)
    step(model, h, seq, 1)
    measured = h.last_stats.saved_peak_bytes if h.last_stats else 0
    shape = Shape(batch=2, seq_len=seq, tokens=2 * seq)
    chosen = choose(profile.options_at(shape), (mode,) * 4)
    other = profile.other_at(shape)
    kept = sum(o.kept for o in chosen) + other
    # The model's peak: everything kept at the end of forward, plus the largest block
    # rematerialised in backward (by then the head's activations are already freed).
    predicted = peak_of(chosen, other)
    assert 0.9 * kept <= measured <= 1.1 * predicted, (mode, measured, kept, predicted)
    if mode == Mode.STORE:
        assert abs(measured - predicted) <= 0.10 * predicted
    h.close()


def _flops(model: torch.nn.Module, h: client.Handle) -> dict[str, int]:
    """A step's flops: of the linear layers (mm, addmm), and of everything."""
    with FlopCounterMode(display=False) as counter:
        step(model, h, 32, 3)
    by_op = counter.get_flop_counts()["Global"]
    linear = sum(n for op, n in by_op.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    return {"linear": int(linear), "total": int(counter.get_total_flops())}


def test_recompute_reruns_every_matmul_and_selective_only_the_attention_core() -> None:
    model = tiny_model(seed=4)
    h = client.attach(model, budget_bytes=10**12)
    step(model, h, 32, 0)
    flops = {}
    for mode in (Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE):
        h.pin_modes(mode)
        step(model, h, 32, 1)  # apply the modes at the step boundary
        flops[mode] = _flops(model, h)
    assert flops[Mode.RECOMPUTE]["linear"] > flops[Mode.STORE]["linear"], "full recomputation reruns linear layers"
    assert flops[Mode.SELECTIVE]["linear"] == flops[Mode.STORE]["linear"], "selective keeps linear layers' outputs"
    assert flops[Mode.STORE]["total"] < flops[Mode.SELECTIVE]["total"] < flops[Mode.RECOMPUTE]["total"], (
        "selective reruns the attention core (q·kᵀ, weights·v) and nothing costlier"
    )
    h.close()


def _backward_flops(model: torch.nn.Module, h: client.Handle) -> dict[str, int]:
    """A step's flops by the module that ran them (the attention's and the MLP's matmuls), and in all."""
    with FlopCounterMode(display=False) as counter:
        step(model, h, 32, 3)
    by_module = counter.get_flop_counts()
    return {
        "attn": sum(int(sum(v.values())) for k, v in by_module.items() if k.endswith(".attn")),
        "mlp": sum(int(sum(v.values())) for k, v in by_module.items() if k.endswith(".mlp")),
        "total": int(counter.get_total_flops()),
    }


def test_a_part_recomputes_alone_and_torchtitans_policy_reruns_every_other_matmul() -> None:
    model = tiny_model(seed=4)
    h = client.attach(model, budget_bytes=10**12)
    step(model, h, 32, 0)
    flops = {}
    for mode in (Mode.STORE, Mode.ATTENTION, Mode.MLP, Mode.TITAN, Mode.RECOMPUTE):
        h.pin_modes(mode)
        step(model, h, 32, 1)  # apply the modes at the step boundary
        flops[mode] = _backward_flops(model, h)
    store, attn, mlp = flops[Mode.STORE], flops[Mode.ATTENTION], flops[Mode.MLP]
    assert attn["attn"] > store["attn"] and attn["mlp"] == store["mlp"], "attention alone runs again"
    assert mlp["mlp"] > store["mlp"] and mlp["attn"] == store["attn"], "the MLP alone runs again"
    # These linear layers have biases (addmm), which torchtitan's policy always keeps, as it keeps bmm.
    assert store["total"] == flops[Mode.TITAN]["total"] < flops[Mode.RECOMPUTE]["total"]
    h.close()


class _Stack(torch.nn.Module):
    """Blocks of four bias-free linear layers (``mm``, as torchtitan's models' are)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(32, 32, bias=False), torch.nn.GELU())))
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def test_torchtitans_policy_keeps_every_other_matmul() -> None:
    model = _Stack()
    h = client.attach(model, blocks=model.blocks, budget_bytes=10**12)
    x = torch.randn(8, 32)
    extra = {}
    for mode in (None, Mode.STORE, Mode.TITAN, Mode.RECOMPUTE):
        if mode is not None:
            h.pin_modes(mode)
        model(x).sum().backward()  # the profiling step, then a step that applies the pin
        h.step()
        with FlopCounterMode(display=False) as counter:
            model(x).sum().backward()
        h.step()
        if mode is not None:
            extra[mode] = int(counter.get_total_flops())
    one = 2 * 8 * 32 * 32  # a linear layer's forward
    assert extra[Mode.RECOMPUTE] - extra[Mode.STORE] == 2 * 4 * one, "every matmul of both blocks runs again"
    assert extra[Mode.TITAN] - extra[Mode.STORE] == 2 * 2 * one, "every second matmul of each block runs again"
    h.close()


def test_profile_offers_modes_with_shape_terms() -> None:
    model = tiny_model(n_layer=2, d_model=48)
    h = client.attach(model, budget_bytes=10**12, modes=["recompute"])
    step(model, h, 40, 0)
    hello = introspect.hello(h)
    offered = [m.mode for m in hello.blocks[0].modes]
    assert offered == [Mode.STORE, Mode.RECOMPUTE], "only the modes asked for (and STORE) are offered"
    store = hello.blocks[0].modes[0].kept
    assert any(t.seq_exp == 2 for t in store.terms), "attention scores scale with seq^2"
    assert any(t.seq_exp == 1 and t.batch_exp == 1 for t in store.terms)
    h.close()
    with pytest.raises(ValueError, match="modes: unknown mode"):
        client.attach(tiny_model(), modes=["teleport"])


def test_blocks_alike_are_priced_alike_by_their_median() -> None:
    def measure(seconds: float, saved: int = 1000) -> BlockMeasure:
        kept = Size.linear(saved)
        return BlockMeasure(
            saved_bytes=saved,
            input_bytes=100,
            forward_seconds=seconds,
            modes=(
                ModeCost(mode=Mode.STORE, kept=kept),
                ModeCost(mode=Mode.RECOMPUTE, kept=Size.linear(100), transient=kept, extra_seconds=seconds),
                ModeCost(mode=Mode.MLP, kept=Size.linear(600), transient=Size.linear(400), extra_seconds=seconds / 5),
            ),
        )

    # A cold first block, one preempted, two as they run warm; a block of another layer; one never profiled.
    raw = [measure(0.020), measure(0.100), measure(0.010), measure(0.012), measure(0.050, saved=3000), None]
    priced = alike_seconds(raw)
    median = 0.016  # of 0.010, 0.012, 0.020 and 0.100
    for m in priced[:4]:
        assert m is not None
        assert m.forward_seconds == pytest.approx(median)
        assert [c.extra_seconds for c in m.modes] == pytest.approx([0.0, median, median / 5])
        assert m.modes[2].kept == Size.linear(600), "only the seconds move"
    assert priced[4] is raw[4] and priced[5] is None, "a block unlike the others keeps its own"


def test_a_profile_prices_alike_blocks_alike_and_no_part_above_its_block() -> None:
    model = tiny_model(n_layer=3, d_model=48)
    h = client.attach(model, budget_bytes=10**12)
    step(model, h, 40, 0)
    hello = introspect.hello(h)
    blocks = hello.blocks
    prices = [{m.mode: m.extra_seconds - m.fixed_seconds for m in b.modes} for b in blocks]
    assert all(p == prices[0] for p in prices), "the blocks are alike: one price for each mode"
    recompute = prices[0][Mode.RECOMPUTE]
    assert recompute == pytest.approx(blocks[0].forward_seconds) and recompute > 0
    # A part's ops are some of the block's, timed alike: no part costs more than the whole block.
    assert 0 < prices[0][Mode.ATTENTION] < recompute and 0 < prices[0][Mode.MLP] < recompute
    assert prices[0][Mode.ATTENTION] + prices[0][Mode.MLP] <= recompute
    # The checkpoint's own work around a region grows with what the region saves: a part saves less.
    fixed = {m.mode: m.fixed_seconds for m in blocks[0].modes}
    assert fixed[Mode.STORE] == 0 and fixed.get(Mode.COMPRESS, 0) == 0
    assert 0 < fixed[Mode.MLP] <= fixed[Mode.RECOMPUTE] and 0 < fixed[Mode.ATTENTION] <= fixed[Mode.RECOMPUTE]
    # An op policy's timed forward holds its checkpoint's forward hooks: its price holds the backward's alone.
    assert fixed[Mode.SELECTIVE] == fixed[Mode.TITAN] <= fixed[Mode.RECOMPUTE]
    h.close()
