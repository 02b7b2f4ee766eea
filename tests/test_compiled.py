"""``attach(model, compile=...)``: compiled block variants switched between steps, on the CPU.

Compiling is slow on a small CPU machine, so one tiny model (2 blocks, width 32,
lengths 8-16) serves every test. Most tests use the ``aot_eager`` backend, which
runs everything compile does (dynamo's capture and guards, the checkpoint as a
higher-order op, AOT autograd's joint graph and partitioner) but Inductor's code
generation; one test runs Inductor itself.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from rematd import client, wire
from rematd.client import introspect
from rematd.client.blocks import compiled as compiled_module
from rematd.client.demo.tiny_gpt import TinyGPT, lm_loss
from rematd.client.errors import UnsupportedModel
from rematd.client.service.folding import fold
from rematd.planner import Mode, Shape
from rematd.planner.messages import BlockProfile, Hello, InvalidMessage, StepStats
from rematd.planner.timing import FORWARD_LIKE, LIMITS, PRICED, STEP
from rematd.server import ServeConfig, ServiceThread
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc
from tests.helpers import batch, tiny_model

# Steps of the switching scenario: (sequence length, modes pinned for the two blocks; None: the
# profiling step). Lengths 8, 12, 16: the second length makes the shapes dynamic, the third costs nothing.
SCENARIO: list[tuple[int, list[str] | None]] = [
    (8, None),
    (8, ["store", "store"]),
    (8, ["recompute", "selective"]),
    (12, ["selective", "recompute"]),
    (16, ["store", "recompute"]),
    (16, ["offload", "selective"]),
    (12, ["recompute", "recompute"]),
]


Run = tuple[list[list[torch.Tensor]], client.Handle, list[StepStats]]


def _train(
    compile: bool | str, steps: list[tuple[int, list[str] | None]], modes: list[str] | None = None, dropout: float = 0.0
) -> Run:
    """Train ``steps``; every step's gradients, the handle, every step's stats."""
    model = tiny_model(n_layer=2, d_model=32, dropout=dropout)
    h = client.attach(model, compile=compile, modes=modes)
    grads = []
    stats = []
    for i, (seq, pin) in enumerate(steps):
        h.pin_modes(pin)
        lm_loss(model, batch(seq, seed=i)).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        h.step()
        if pin is not None:
            assert h.modes == tuple(Mode[m.upper()] for m in pin)
        assert h.last_stats is not None and h.last_stats.step == i
        stats.append(h.last_stats)
    return grads, h, stats


def _largest_relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b, strict=True))


def test_compiled_variants_switch_share_graphs_and_match_eager() -> None:
    eager_grads, _, eager_stats = _train(False, SCENARIO)
    grads, h, step_stats = _train("aot_eager", SCENARIO)
    # aot_eager runs the same aten ops as eager rematd: every step's gradients are equal.
    for step, (g, e) in enumerate(zip(grads, eager_grads, strict=True)):
        assert _largest_relative_error(g, e) == 0.0, step
    # What the compiled functions save passes the accounting's hooks, so the CPU budget still binds.
    # The partitioner saves its own choice: measured 3% more than eager autograd under store, 23% more
    # with a selective block, whose eager count lets go of the kept outputs no op saves as the block's
    # backward begins (as torch frees them) where the compiled function's saved set lives to its end.
    for step, (c, e) in enumerate(zip(step_stats, eager_stats, strict=True)):
        assert 0.5 * e.saved_peak_bytes < c.saved_peak_bytes <= 1.3 * e.saved_peak_bytes, step
    per_step = [s.recompiles for s in step_stats]
    # Profiling runs eagerly; the next step compiles store, selective and recompute ahead, one graph
    # each for both blocks (a graph per block instance would be 6); the second length recompiles the
    # mode in use and, ahead, the other two, dynamic from then on; a third length and offload (store
    # under the offloader's hooks) compile nothing.
    assert per_step == [0, 3, 0, 3, 0, 0, 0]
    # The compiled offloaded block went through the side-stream offloader, fetched back ahead of its backward.
    off = introspect.offloader(h)
    assert off.prefetched >= 1 and off.late == 0
    stats = h.compile_stats
    assert stats is not None
    assert stats.graphs == 6
    assert stats.by_mode == {Mode.STORE: 2, Mode.SELECTIVE: 2, Mode.RECOMPUTE: 2}
    assert stats.capped_modes == frozenset()
    assert stats.seconds > 0
    h.close()


def test_inductor_gradients_within_compile_tolerance() -> None:
    # Inductor fuses and reorders float32 arithmetic: its gradients differ from eager rematd's by
    # rounding (measured up to 1.0e-6 of each tensor's largest value over the whole scenario).
    # Two modes offered (store, recompute) keep its compile time down.
    steps = [(8, None), (8, ["store", "store"]), (8, ["recompute", "store"])]
    grads, h, step_stats = _train(True, steps, modes=["recompute"])
    eager = _train(False, steps, modes=["recompute"])[0]
    for step, (g, e) in enumerate(zip(grads, eager, strict=True)):
        assert _largest_relative_error(g, e) < 1e-5, step
    assert [s.recompiles for s in step_stats] == [0, 2, 0]
    stats = h.compile_stats
    assert stats is not None and stats.seconds > 0
    assert stats.by_mode == {Mode.STORE: 1, Mode.SELECTIVE: 0, Mode.RECOMPUTE: 1}
    h.close()


def test_hugging_face_gpt2_blocks_compile_and_switch() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    def run(compile: bool | str) -> tuple[list[list[torch.Tensor]], client.Handle, list[int]]:
        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
        h = client.attach(model, compile=compile)
        grads, recompiles = [], []
        steps = [(16, None), (16, None), (16, ["recompute", "selective"]), (24, ["store", "store"])]
        for i, (seq, pin) in enumerate(steps):
            h.pin_modes(pin)
            ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(i))
            model(input_ids=ids, labels=ids).loss.backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            model.zero_grad(set_to_none=True)
            h.step()
            assert h.last_stats is not None
            recompiles.append(h.last_stats.recompiles)
        return grads, h, recompiles

    eager = run(False)[0]
    grads, h, recompiles = run("aot_eager")
    for g, e in zip(grads, eager, strict=True):
        assert _largest_relative_error(g, e) == 0.0
    # Both GPT2Block instances share each mode's graph; a new length recompiles every mode once.
    assert recompiles == [0, 3, 0, 3]
    h.close()


def test_a_mode_at_its_graph_bound_compiles_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_module, "MAX_GRAPHS_PER_MODE", 1)
    steps = [(8, None), (8, ["recompute", "store"]), (12, ["recompute", "store"]), (8, ["store", "recompute"])]
    grads, h, step_stats = _train("aot_eager", steps)
    eager = _train(False, steps)[0]
    stats = h.compile_stats
    assert stats is not None
    # The ahead compile reached the bound of 1 graph for every mode; the new length ran eagerly
    # instead of recompiling, the first length again ran the graphs built for it.
    assert [s.recompiles for s in step_stats] == [0, 3, 0, 0]
    assert stats.capped_modes == {Mode.RECOMPUTE, Mode.STORE, Mode.SELECTIVE}
    assert stats.graphs == 3
    for g, e in zip(grads, eager, strict=True):
        assert _largest_relative_error(g, e) == 0.0
    h.close()


def test_a_backend_that_fails_leaves_the_blocks_eager(caplog: pytest.LogCaptureFixture) -> None:
    import torch._dynamo

    def failing(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> None:
        raise RuntimeError("this backend cannot compile")

    if "rematd_test_failing" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(failing, name="rematd_test_failing")
    steps = [(8, None), (8, ["recompute", "selective"]), (12, ["store", "recompute"])]
    grads, h, step_stats = _train("rematd_test_failing", steps)
    eager = _train(False, steps)[0]
    for g, e in zip(grads, eager, strict=True):
        assert _largest_relative_error(g, e) == 0.0
    stats = h.compile_stats
    assert stats is not None and stats.failed_modes == {Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE}
    assert stats.graphs == 0 and [s.recompiles for s in step_stats] == [0, 0, 0]
    assert "this backend cannot compile" in caplog.text
    # A forward that fell back to eager is timed once at most: two blocks, at most two timed forwards.
    for s in step_stats[1:]:
        assert sum(m.blocks for m in s.mode_seconds) <= 2, s.mode_seconds
    assert sum(m.blocks for m in step_stats[2].mode_seconds) == 2, "eager from then on: both timed"
    h.close()


def test_compiled_steps_report_no_compile_time_and_scales_stay_sane() -> None:
    """A step that compiled reports no mode timings (its forwards carry the compile), and the compiled
    checkpoint variants are never timed (their rematerialisation runs inside the graph, out of reach),
    so the planner keeps the profile's price for them instead of learning a free or a 10x dear recompute."""
    steps: list[tuple[int, list[str] | None]] = [
        (8, None),
        (8, ["recompute", "recompute"]),
        (8, ["recompute", "recompute"]),
        (8, ["selective", "recompute"]),
        (8, ["store", "store"]),
        (12, ["recompute", "recompute"]),
        (12, ["store", "recompute"]),
    ]
    _, h, step_stats = _train("eager", steps)
    assert sum(s.recompiles for s in step_stats) > 0, "the scenario compiles"
    for s in step_stats:
        if s.recompiles:
            assert s.mode_seconds == (), (s.step, s.mode_seconds)
        timed = {m.mode for m in s.mode_seconds}
        assert not timed & {Mode.SELECTIVE, Mode.RECOMPUTE}, (s.step, s.mode_seconds)
    assert any(m.mode == Mode.STORE for s in step_stats for m in s.mode_seconds), "stored forwards still timed"
    session = introspect.session(h)
    assert session is not None
    timing = session.controller.timing
    assert not timing.measured_modes, "no mode's price was learnt from compile time"
    # Until measured, recomputing is priced as the stored blocks' measured forwards are against the profile's
    # (compiled here, eager there; one timed step of forwards of microseconds, where the compiled call's own cost
    # and a busy machine's stall weigh most: measured from 0.2x to 5.1x): one estimate, spread to the other modes
    # only when dearer than the profile. Compile seconds in it would read at the limit (its highest power of STEP).
    scales = dict(timing.scales)
    assert len(set(scales.values())) <= 1, scales
    estimate = next(iter(scales.values()), 1.0)
    assert set(scales) == (set(FORWARD_LIKE) if estimate < 1 else set(PRICED) if estimate > 1 else set()), scales
    assert LIMITS[0] < estimate < LIMITS[1] / STEP, scales
    # A compiled checkpoint's hooks are in its graph, not Python's: no share of its price is the eager
    # checkpoint's own work; a part, which runs eager, keeps that share.
    fixed = {m.mode: m.fixed_seconds for m in introspect.hello(h).blocks[0].modes}
    assert fixed[Mode.RECOMPUTE] == 0 and fixed.get(Mode.SELECTIVE, 0.0) == 0, fixed
    assert all(fixed[m] > 0 for m in (Mode.ATTENTION, Mode.MLP) if m in fixed), fixed
    h.close()


def test_compile_needs_a_torch_with_set_stance() -> None:
    compiled_module.check_torch_version("2.6.0+cpu")
    compiled_module.check_torch_version(torch.__version__)
    with pytest.raises(ValueError, match=r"compile= needs torch >= 2\.6.*2\.5\.1"):
        compiled_module.check_torch_version("2.5.1+cu121")


def test_whole_model_compile_is_refused_pointing_at_compile_true() -> None:
    model = torch.compile(tiny_model(n_layer=2, d_model=32))
    with pytest.raises(UnsupportedModel, match=r"compile=True"):
        client.attach(model)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [("no-such-backend", ValueError, "no-such-backend"), (1, TypeError, "compile must be"), ("", TypeError, "compile")],
)
def test_bad_compile_argument_names_itself(value: object, error: type[Exception], match: str) -> None:
    model = tiny_model(n_layer=2, d_model=32)
    with pytest.raises(error, match=match):
        client.attach(model, compile=value)  # type: ignore[arg-type]
    assert isinstance(model, TinyGPT) and "forward" not in model.h[0].__dict__  # left untouched


def test_recompiles_cross_the_wire_and_fold() -> None:
    stats = StepStats(
        step=3, shape=Shape(batch=2, seq_len=8, tokens=16), budget_bytes=10, recompiles=2, compile_seconds=1.5
    )
    back = wire.stats_from_pb(wire.stats_to_pb(stats))
    assert (back.recompiles, back.compile_seconds) == (2, 1.5)
    later = StepStats(step=4, shape=stats.shape, budget_bytes=10, recompiles=1, compile_seconds=0.25)
    folded = fold(stats, later)
    assert (folded.recompiles, folded.compile_seconds) == (3, 1.75)
    with pytest.raises(InvalidMessage, match="compile_seconds"):
        StepStats(step=1, budget_bytes=10, compile_seconds=-1.0).validate()
    with pytest.raises(InvalidMessage, match="recompiles"):
        StepStats(step=1, budget_bytes=10, recompiles=-1).validate()


def test_service_counts_a_jobs_recompiles(tmp_path: Path) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    svc.start()
    try:
        bound = svc.service.bound
        assert bound is not None
        blocks = tuple(
            BlockProfile(index=i, name=f"h.{i}", saved_bytes=1000, input_bytes=100, forward_seconds=0.01)
            for i in range(2)
        )
        shape = Shape(batch=1, seq_len=8, tokens=8)
        hello = Hello(job_id="compiled-job", blocks=blocks, profile_shape=shape, budget_bytes=10_000)
        reports = [StepStats(step=i, shape=shape, budget_bytes=10_000, recompiles=n) for i, n in enumerate((0, 3, 2))]
        messages = [pb.ClientMessage(hello=wire.hello_to_pb(hello))]
        messages += [pb.ClientMessage(stats=wire.stats_to_pb(r)) for r in reports]
        # No goodbye: a job's count lives as long as the job is live on the service (a stream that
        # ends without one leaves the rank disconnected, able to resume).
        with grpc.insecure_channel(bound.grpc) as channel:
            list(pb_grpc.AdvisorStub(channel).Session(iter(messages), timeout=10))
        job = httpx.get(f"http://{bound.http}/api/v1/jobs/compiled-job", timeout=10).json()
        assert job["recompiles"] == 5
        scraped = httpx.get(f"http://{bound.http}/metrics", timeout=10).text
        assert 'rematd_recompiles_total{job="compiled-job"} 5.0' in scraped
    finally:
        svc.stop()
    # The count is in the store: a restarted service shows it, and the rank's run goes on counting.
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    svc.start()
    try:
        bound = svc.service.bound
        assert bound is not None
        job = httpx.get(f"http://{bound.http}/api/v1/jobs/compiled-job", timeout=10).json()
        assert job["recompiles"] == 5
        resumed = dataclasses.replace(hello, plan_version=1)
        later = StepStats(step=3, shape=shape, budget_bytes=10_000, recompiles=1)
        messages = [pb.ClientMessage(hello=wire.hello_to_pb(resumed)), pb.ClientMessage(stats=wire.stats_to_pb(later))]
        with grpc.insecure_channel(bound.grpc) as channel:
            list(pb_grpc.AdvisorStub(channel).Session(iter(messages), timeout=10))
        job = httpx.get(f"http://{bound.http}/api/v1/jobs/compiled-job", timeout=10).json()
        assert job["recompiles"] == 6
    finally:
        svc.stop()


def test_compiled_benchmark_runs_its_strategies_on_the_cpu() -> None:
    from bench import compiled as bench
    from bench.compiled_setup import QUICK, Setup

    setup = Setup(**{**QUICK, "steps": 1, "warmup": 1}, device="cpu", backend="aot_eager", bf16=False)
    every_2nd = bench.measure(setup, "block-every-2nd")
    # Two kinds (checkpointed, plain), each one graph for the blocks that run it.
    assert every_2nd["graphs"] == 2 and every_2nd["peak_mib"] > 0
    rows = bench.rematd_through(setup, [2**30, 1])
    assert [r["graphs"] for r in rows] == [3, 3]
    # A byte fits nothing: the leanest plan recomputes the first block (the last one's stored activations
    # are released before it rematerialises, so recomputing that one too would keep more; selective there
    # lets go of the kept outputs its backward does not read, as recomputing it would).
    assert rows[0]["modes"] == ".." and rows[1]["modes"] in ("RR", "R.", "Rs")
