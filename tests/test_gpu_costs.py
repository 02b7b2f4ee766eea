"""The planner fed what an H100 measured (tests/data/h100_gpt2.json): plans no slower than the static
strategies users run, and peaks that match the allocator's."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.planner import (
    BlockCost,
    Controller,
    ControllerConfig,
    Mode,
    ModeCost,
    ModeSeconds,
    Profile,
    Shape,
    Size,
    StepObservation,
)
from rematd.planner.cost import choose, peak_of
from rematd.planner.shapes import at_shape
from rematd.planner.solvers import every_k_blocks

from .helpers import tiny_model, train_step

DATA = Path(__file__).parent / "data" / "h100_gpt2.json"
N = 24
SHAPE = Shape(batch=8, seq_len=1024, tokens=8192)
S, K, R, OFF = Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE, Mode.OFFLOAD
DEFAULT = frozenset({S, K, R})


@cache
def data() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DATA.read_text())
    return loaded


def run(name: str) -> dict[str, Any]:
    found: dict[str, Any] = data()["runs"][name]
    return found


def step_s() -> float:
    """No checkpointing, in the file the pinned runs come from."""
    return float(run("rematd_pin_store")["median_s"])


def measured_block_seconds() -> dict[Mode, float]:
    """What each mode added to a whole step, per block: every block pinned to it, against storing."""
    return {
        m: (run(f"rematd_pin_{m.name.lower()}")["median_s"] - step_s()) / N
        for m in (Mode.SELECTIVE, Mode.RECOMPUTE, Mode.OFFLOAD)
    }


def static() -> int:
    return int(data()["static_bytes"])


def other() -> int:
    """What the profiling step's allocator peak (every block stored) holds beyond static memory and the
    blocks' saved bytes: the client's measure of memory outside the blocks."""
    return int(run("none")["max_peak"]) - static() - N * int(data()["profiled_block_bytes"]["saved"])


def profile(seconds: dict[Mode, float] | None = None, modes: frozenset[Mode] = frozenset(Mode)) -> Profile:
    b = data()["profiled_block_bytes"]
    saved, inp, sel = int(b["saved"]), int(b["input"]), int(b["selective_kept"])
    secs = seconds or measured_block_seconds()
    costs = [
        ModeCost(mode=S, kept=Size.linear(saved)),
        ModeCost(mode=K, kept=Size.linear(sel), transient=Size.linear(saved - sel), extra_seconds=secs[K]),
        ModeCost(mode=R, kept=Size.linear(inp), transient=Size.linear(saved), extra_seconds=secs[R]),
        ModeCost(mode=OFF, kept=Size(), transient=Size.linear(saved), extra_seconds=secs[OFF]),
    ]
    block = BlockCost(
        saved_bytes=saved,
        input_bytes=inp,
        forward_seconds=secs[R],
        modes=tuple(c for c in costs if c.mode in modes),
    )
    return Profile(blocks=(block,) * N, shape=SHAPE, other=Size.linear(other()))


def predicted_peak(modes: tuple[Mode, ...]) -> int:
    return static() + other() + peak_of(choose(profile().options_at(), modes))


def seconds_of(modes: tuple[Mode, ...]) -> float:
    costs = measured_block_seconds()
    return sum(costs.get(m, 0.0) for m in modes)


def every(k: int) -> tuple[Mode, ...]:
    chosen = set(every_k_blocks(N, k))
    return tuple(R if i in chosen else S for i in range(N))


STATIC = {"none": every(0), "every 3rd": every(3), "every 2nd": every(2), "full": every(1)}


def decode(letters: str, peak: int) -> tuple[Mode, ...]:
    """A run's modes from their first letters; ``S`` is store or selective, and these runs' peaks (and
    step times) say store."""
    return tuple({"S": S, "R": R, "O": OFF}[c] for c in letters)


@pytest.mark.parametrize(
    ("name", "modes"),
    [
        ("none", every(0)),
        ("every3", every(3)),
        ("every2", every(2)),
        ("full", every(1)),
        ("rematd_pin_selective", (K,) * N),
        ("rematd_pin_recompute", (R,) * N),
        ("rematd_pin_offload", (OFF,) * N),
        ("rematd@0.3", None),
        ("rematd@0.5", None),
    ],
)
def test_predicted_peaks_are_within_10_percent_of_the_allocators(name: str, modes: tuple[Mode, ...] | None) -> None:
    r = run(name)
    chosen = modes or decode(r["final_modes"], r["max_peak"])
    predicted, measured = predicted_peak(chosen), r["max_peak"]
    assert abs(predicted - measured) <= 0.10 * measured, f"{name}: predicted {predicted:,} against {measured:,}"
    if "predicted_peak" in r and "@" in name:  # pinned runs record the unpinned plan's prediction
        # Before memory outside the blocks was modelled, the same plan was predicted 36-47% low.
        assert r["predicted_peak"] < 0.7 * measured


def budget(frac: float) -> int:
    return static() + int(frac * int(data()["act_bytes"]))


def best_static(target: int) -> tuple[str, float]:
    """The fastest static strategy whose peak fits ``target``, under the same measured costs; where
    none fits, the leanest (full recomputation)."""
    fitting = [(seconds_of(m), name) for name, m in STATIC.items() if predicted_peak(m) <= target]
    secs, name = min(fitting) if fitting else (seconds_of(STATIC["full"]), "full")
    return name, secs


@pytest.mark.parametrize("margin", [0.1, 0.02])
@pytest.mark.parametrize("modes", [DEFAULT, frozenset(Mode)], ids=["default-modes", "offload-opted-in"])
@pytest.mark.parametrize("frac", [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
def test_plans_are_no_slower_than_the_best_static_strategy_that_fits(
    frac: float, modes: frozenset[Mode], margin: float
) -> None:
    controller = Controller(profile(modes=modes), ControllerConfig(margin_ratio=margin))
    decision = controller.initial(budget_bytes=budget(frac), static_bytes=static())
    target = decision.target_bytes
    name, best = best_static(target)
    ours = seconds_of(decision.modes)
    fits = predicted_peak(decision.modes) <= target
    if predicted_peak(STATIC[name]) <= target:
        assert fits, "a static strategy fits, so the plan fits too"
        assert ours <= best + 1e-9, (
            f"at {frac:.0%}: {ours / step_s() + 1:.3f}x against {name}'s {best / step_s() + 1:.3f}x ({decision.modes})"
        )
    elif not fits:
        # Nothing fits the target: never over the budget where a plan is predicted under it.
        under = [m for m in STATIC.values() if predicted_peak(m) <= budget(frac)]
        if under:
            assert predicted_peak(decision.modes) <= budget(frac), decision.reason
            assert ours <= min(seconds_of(m) for m in under) + 1e-9
    else:
        # Only offload, opted in, reaches the target: it is what honours the budget.
        assert OFF in modes and OFF in decision.modes
    assert decision.predicted_peak_bytes == predicted_peak(decision.modes), "the decision reports the whole peak"


@pytest.mark.parametrize("modes", [DEFAULT, frozenset(Mode)], ids=["default-modes", "offload-opted-in"])
@pytest.mark.parametrize("frac", [0.1, 0.3])
def test_where_nothing_fits_the_plan_is_the_leanest_and_says_by_how_much(frac: float, modes: frozenset[Mode]) -> None:
    controller = Controller(profile(modes=modes), ControllerConfig(margin_ratio=0.1))
    decision = controller.initial(budget_bytes=budget(frac), static_bytes=static())
    if predicted_peak(decision.modes) <= decision.target_bytes:
        assert OFF in modes, "only offload, opted in, can reach this target"
        return
    candidates = [*STATIC.values(), (OFF,) * N, *(((R,) * (N - k) + (S,) * k) for k in range(1, 4))]
    leanest = min(predicted_peak(m) for m in candidates if all(x in modes for x in m))
    if leanest > budget(frac):
        # Nothing is predicted under the budget: the leanest plan, whatever it costs in time (a plan within
        # the prediction's error of it, the fastest of those), and the reason names the gap.
        assert predicted_peak(decision.modes) <= 1.01 * leanest
        assert "no plan fits the budget of" in decision.reason and "over it" in decision.reason, decision.reason
    else:
        assert predicted_peak(decision.modes) <= budget(frac)
        assert "no plan fits the target of" in decision.reason, decision.reason
        assert "the fastest under the budget" in decision.reason, decision.reason


def _timed(modes: tuple[Mode, ...]) -> tuple[ModeSeconds, ...]:
    """What the device measures in a step of ``modes``: each mode's forward, and its rematerialisation.
    A stored block's forward takes about what recomputing it does; selective's surcharge is mostly the
    policy's dispatch in forward (70%), the rest in recompute; offload's, copies in forward."""
    measured = measured_block_seconds()
    forward = measured[R]
    extra = {S: 0.0, K: 0.7 * measured[K], R: 0.0, OFF: measured[OFF]}
    remat = {S: 0.0, K: 0.3 * measured[K], R: measured[R], OFF: 0.0}
    return tuple(
        ModeSeconds(m, modes.count(m), modes.count(m) * remat[m], modes.count(m) * (forward + extra[m]))
        for m in sorted(set(modes))
    )


def _entry(controller: Controller) -> tuple[Mode, ...]:
    return next(e.modes for e in controller.table if e.covers(SHAPE))


@pytest.mark.parametrize("frac", [0.7, 0.9])
def test_whole_step_measurements_keep_plans_off_a_mode_whose_cost_is_mostly_in_forward(frac: float) -> None:
    """The profile as the client takes it on a GPU: recomputation dear (each operation synchronised),
    selective at its non-matmul share. Selective is run (pinned) and measured: its recompute alone looks
    cheaper than recomputing a block, its whole cost is twice that. The plans that follow are as fast as
    the best static strategy, as they would not be were only the rematerialisation counted."""
    fwd = 3 * measured_block_seconds()[R]
    profiled = profile({R: fwd, K: 0.25 * fwd, OFF: 0.02}, modes=DEFAULT)
    controller = Controller(profiled, ControllerConfig(margin_ratio=0.02, loosen_after_steps=2))
    total = budget(frac)
    controller.initial(budget_bytes=total, static_bytes=static())
    for step in range(40):
        modes = (K,) * N if step < 10 else _entry(controller)  # pinned for the first ten steps
        obs = StepObservation(
            step=step,
            peak_bytes=predicted_peak(modes),
            budget_bytes=total,
            static_bytes=static(),
            shape=SHAPE,
            mode_seconds=_timed(modes),
        )
        controller.observe(obs, modes)
    modes = _entry(controller)
    assert K in controller.timing.measured_modes
    _, best = best_static(controller.config.target_bytes(total))
    assert seconds_of(modes) <= best + 1e-9, f"{seconds_of(modes) / step_s() + 1:.3f}x: {modes}"
    assert predicted_peak(modes) <= total


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's peak")
def test_on_cuda_the_peak_outside_the_blocks_is_measured_and_predicted_within_10_percent() -> None:
    model = tiny_model(n_layer=4, d_model=256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # no optimizer state: the peak is the step's own
    h = client.attach(model, optimizer=opt, budget_bytes=2**40)
    for i in range(4):
        train_step(model, opt, 256, i)
    hello = introspect.hello(h)
    assert hello.other_activations.bytes > 0, "logits, the loss, gradients: outside the blocks"
    assert h.last_stats is not None and h.modes == (S,) * 4
    predicted = h.last_stats.static_bytes + hello.other_activations.bytes + sum(b.saved_bytes for b in hello.blocks)
    measured = h.last_stats.peak_allocated_bytes
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)
    h.close()


def test_a_mode_measured_slower_than_recomputing_while_freeing_less_is_never_offered_to_the_solver() -> None:
    p = profile(modes=DEFAULT)
    slow = ((K, 1.21),)  # selective measured 21% dearer than its price (which is at least recomputing's)
    assert {o.mode for o in at_shape(p, None, scales=slow).options[0]} == {S, K, R}, "pricing a plan sees every mode"
    assert {o.mode for o in at_shape(p, None, scales=slow, prune=True).options[0]} == {S, R}
    cheap = ((K, 0.5),)
    assert K in {o.mode for o in at_shape(p, None, scales=cheap, prune=True).options[0]}
