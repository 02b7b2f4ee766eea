"""The compress mode on the CPU: what it keeps and restores, what it leaves alone, what it costs in bytes, how
close its gradients stay, and that the planner takes it only where it was enabled."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rematd import client, wire
from rematd.client import introspect
from rematd.client.blocks import quantize as quantize_module
from rematd.client.blocks.compress import CompressConfig, Compressor, pack_tensor
from rematd.client.blocks.quantize import RESTORE, Kernel, dequantize, quantize
from rematd.client.demo.tiny_gpt import lm_loss
from rematd.planner import Mode, ModeCost, ModeSeconds, Plan, PlannerSession, Profile, Shape, ShapePlan, Size
from rematd.planner.config import ControllerConfig
from rematd.planner.cost import choose, peak_of
from rematd.planner.messages import BlockProfile, Hello, StepStats
from rematd.planner.model import BlockCost

from .distributed import run_ranks
from .helpers import batch, tiny_model

SMALL = CompressConfig(min_bytes=1024)
"""The tiny models' tensors are a few KiB: compress them all the same."""
ALL_COMPRESS = ["store", "recompute", "compress"]


def attached(format: str = "int8", **kwargs: object) -> tuple[nn.Module, client.Handle]:
    model = tiny_model(d_model=64, seed=3, **kwargs)  # type: ignore[arg-type]
    config = CompressConfig(format=format, min_bytes=1024)
    h = client.attach(model, budget_bytes=10**12, modes=ALL_COMPRESS, compress=config)
    lm_loss(model, batch(32, seed=9)).backward()  # the profiling step
    h.step()
    model.zero_grad()
    return model, h


def grads_after(model: nn.Module, h: client.Handle | None, seed: int) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(seed)
    loss = lm_loss(model, batch(32, seed=seed))
    loss.backward()
    if h is not None:
        h.step()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return float(loss.detach()), grads


def error_and_cosine(got: list[torch.Tensor], exact: list[torch.Tensor]) -> tuple[float, float]:
    a, b = torch.cat([g.flatten() for g in got]).double(), torch.cat([g.flatten() for g in exact]).double()
    return float((a - b).norm() / b.norm()), float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize(
    ("field", "value"),
    [("format", "int4"), ("block_size", 0), ("block_size", 100), ("min_bytes", -1), ("compiled_kernels", "yes")],
)
def test_a_bad_setting_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"compress.{field}"):
        CompressConfig(**{field: value})  # type: ignore[arg-type]


def test_compress_is_opt_in_at_attach_and_at_pin() -> None:
    with pytest.raises(ValueError, match="modes= does not enable"):
        client.attach(tiny_model(), compress="fp8")
    model = tiny_model()
    h = client.attach(model, budget_bytes=10**12)
    with pytest.raises(ValueError, match="pin_modes: 'compress' is lossy and opt-in"):
        h.pin_modes("compress")
    with pytest.raises(TypeError, match="compress must be"):
        client.attach(tiny_model(), modes=ALL_COMPRESS, compress=8)  # type: ignore[arg-type]
    h.close()


@pytest.mark.parametrize("format", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_restored_tensors_have_their_dtype_shape_and_layout(format: str, dtype: torch.dtype) -> None:
    config = CompressConfig(format=format, min_bytes=0)
    base = torch.randn(3, 50, 7, dtype=dtype)  # 1050 elements: the last block of 128 is padded
    # Contiguous, permuted (comes back permuted), strided with gaps (comes back contiguous).
    for t, strides in ((base, base.stride()), (base.mT, base.mT.stride()), (base[:, ::2], (175, 7, 1))):
        packed = pack_tensor(t, config)
        assert packed is not None
        out = packed.restore()
        assert (out.dtype, out.shape, out.stride()) == (t.dtype, t.shape, strides)
        bound = {"int8": 0.01, "fp8": 0.07, "bf16": 0.005}[format]
        assert float((out.double() - t.double()).norm() / t.double().norm()) < bound


def test_each_block_of_elements_has_its_own_scale() -> None:
    x = torch.randn(16 * 128)
    x[5] = 1e4  # one outlier, in the first block of 128
    packed = pack_tensor(x, CompressConfig(format="int8", min_bytes=0))
    assert packed is not None
    out = packed.restore()
    rest = slice(128, None)
    bound = float(x[rest].abs().view(-1, 128).amax(dim=1).max()) / 254 * 1.001
    assert float((out[rest] - x[rest]).abs().max()) <= bound, "the other blocks keep their own resolution"
    assert float((out[rest] - x[rest]).abs().max()) < 1e4 / 254 / 100
    assert float(out[5]) == pytest.approx(1e4, rel=1e-3)


@pytest.mark.parametrize("format", ["int8", "fp8"])
def test_compiled_kernels_quantize_and_restore_as_the_plain_ones(format: str) -> None:
    """Tensors past the kernels' size thresholds go through ``torch.compile``'s fused kernels: the values
    they keep and restore match the plain operations' to within one step of the format."""
    n = RESTORE[torch.int8].compiled_from + 5 * 128 + 3  # the last block padded
    x = torch.randn(n) * torch.logspace(-2, 2, n)  # blocks of every magnitude
    x[7] = 3e3  # an outlier: its block's scale, no other's
    got = {c: quantize(x, format, 128, compiled=c) for c in (True, False)}
    assert all(g is not None for g in got.values())
    (qc, sc), (qp, sp) = got[True], got[False]  # type: ignore[misc]
    assert sc is not None and sp is not None
    torch.testing.assert_close(sc, sp, rtol=1e-6, atol=0.0)
    steps = (qc.float() - qp.float()).abs().max() if format == "int8" else 0.0
    assert float(steps) <= 1.0, "the compiled rounding differs from the plain one by at most one step"
    restored = {c: dequantize(qc, sc, x.numel(), torch.float32, compiled=c) for c in (True, False)}
    torch.testing.assert_close(restored[True], restored[False], rtol=1e-6, atol=0.0)
    out = restored[True]
    assert out.shape == x.shape
    blocks = F.pad(x, (0, -x.numel() % 128)).view(-1, 128).abs().amax(dim=1)
    bound = {"int8": 1 / 127, "fp8": 1 / 8}[format]  # half a step (int8); a relative 1/16 and rounding (fp8)
    err = F.pad(out - x, (0, -x.numel() % 128)).view(-1, 128).abs().amax(dim=1)
    assert bool((err <= blocks * bound).all())


def test_kernels_that_cannot_compile_run_plainly_and_say_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        def run(*a: object) -> object:
            raise RuntimeError("no compiler here")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(Kernel, "compiling", True)
    kernel = Kernel(quantize_module._int8, 0)
    x = torch.randn(4 * 128)
    with caplog.at_level("WARNING", logger="rematd.client"):
        q, scale = kernel(x, 128)
        assert Kernel.compiling is False, "every kernel runs plainly from now on"
        assert sum("compiling the compress mode's kernels failed" in r.message for r in caplog.records) == 1
        q2, scale2 = kernel(x, 128)
    assert torch.equal(q, q2) and torch.equal(scale, scale2)
    assert torch.equal(q, quantize_module._int8(x, 128)[0])


def saved(node: object, name: str) -> torch.Tensor:
    value = getattr(node, name)
    assert isinstance(value, torch.Tensor)
    return value


def test_integers_booleans_parameters_constants_and_small_tensors_are_kept_as_they_are() -> None:
    w = nn.Parameter(torch.randn(256, 256))
    leaf = torch.randn(64, 256, requires_grad=True)
    x = leaf * 1.0  # an activation: not a leaf
    mask = torch.rand(64, 256) > 0.5
    index = torch.randint(0, 256, (64, 8))
    small = torch.randn(8, 8, requires_grad=True) * 1.0
    table = torch.randn(64, 256)  # a constant handed to the block (a rotary table)
    compressor = Compressor(CompressConfig(min_bytes=4096))
    with compressor.block(constants=frozenset({table.untyped_storage()._cdata})):
        a = x.masked_fill(mask, 0.0)
        b = a @ w.t()
        c = b.gather(1, index)
        d = small * small
        e = b * table
    assert saved(a.grad_fn, "_saved_mask").data_ptr() == mask.data_ptr()
    assert saved(b.grad_fn, "_saved_mat2").data_ptr() == w.data_ptr(), "a view of a parameter"
    assert saved(c.grad_fn, "_saved_index").data_ptr() == index.data_ptr()
    assert saved(d.grad_fn, "_saved_self").data_ptr() == small.data_ptr(), "under min_bytes"
    assert saved(e.grad_fn, "_saved_other").data_ptr() == table.data_ptr(), "a constant the caller holds"
    restored = saved(b.grad_fn, "_saved_self")
    assert restored.data_ptr() != a.data_ptr() and torch.allclose(restored, a, atol=0.05), "the activation"
    (c.sum() + d.sum() + e.sum()).backward()
    assert w.grad is not None and leaf.grad is not None


def test_blocks_keep_the_compressed_bytes_as_the_profile_predicts() -> None:
    model, h = attached()
    profile = introspect.hello(h).profile()
    costs = {m.mode: m for m in profile.blocks[0].mode_costs()}
    assert costs[Mode.COMPRESS].kept.bytes <= 0.35 * costs[Mode.STORE].kept.bytes
    assert costs[Mode.COMPRESS].extra_seconds > 0, "priced from a measured compress and restore"
    peaks = {}
    for mode in (Mode.STORE, Mode.COMPRESS):
        h.pin_modes(mode)
        grads_after(model, h, seed=1)
        assert h.last_stats is not None
        peaks[mode] = h.last_stats.saved_peak_bytes
        shape = Shape(batch=2, seq_len=32, tokens=64)
        chosen = choose(profile.options_at(shape), (mode,) * 4)
        other = profile.other_at(shape)
        kept = sum(o.kept for o in chosen) + other
        assert 0.9 * kept <= peaks[mode] <= 1.1 * peak_of(chosen, other), (mode, peaks[mode], kept)
    timed = {m.mode: m for m in h.last_stats.mode_seconds}
    assert timed[Mode.COMPRESS].blocks == 4 and timed[Mode.COMPRESS].seconds > 0, "restores timed in backward"
    h.close()


@pytest.mark.parametrize("format", ["int8", "fp8", "bf16"])
def test_switching_into_and_out_of_compress_trains_close_to_exact(format: str) -> None:
    ref = tiny_model(d_model=64, seed=3, dropout=0.1)
    model, h = attached(format, dropout=0.1)
    grads_after(ref, None, seed=9)  # the same first step as the handle's profiling one
    worst = 0.0
    for step, mode in enumerate(["compress", "store", "compress", "recompute", "compress"]):
        h.pin_modes(mode)
        loss, got = grads_after(model, h, seed=step)
        exact_loss, exact = grads_after(ref, None, seed=step)
        assert math.isfinite(loss) and loss == exact_loss, "forward is untouched: dropout draws the same"
        error, cosine = error_and_cosine(got, exact)
        if mode != "compress":
            assert error == 0.0, "the other modes stay bitwise exact after compressed steps"
        worst = max(worst, error)
        assert cosine >= 0.999, (mode, cosine)
    assert 0 < worst <= 0.03
    h.close()


def test_compiled_blocks_compress_what_the_graph_saves() -> None:
    model = tiny_model(d_model=64, seed=3)
    h = client.attach(model, budget_bytes=10**12, modes=ALL_COMPRESS, compress=SMALL, compile="aot_eager")
    ref = tiny_model(d_model=64, seed=3)
    grads_after(ref, None, seed=9)
    lm_loss(model, batch(32, seed=9)).backward()
    h.step()
    model.zero_grad()
    peaks = {}
    for mode in ("store", "compress"):
        h.pin_modes(mode)
        _, got = grads_after(model, h, seed=1)
        _, exact = grads_after(ref, None, seed=1)
        assert h.last_stats is not None
        peaks[mode] = h.last_stats.saved_peak_bytes
    assert peaks["compress"] < 0.5 * peaks["store"]
    error, cosine = error_and_cosine(got, exact)
    assert error <= 0.03 and cosine >= 0.999
    h.close()


def profile_offering_compress() -> Profile:
    store = ModeCost(mode=Mode.STORE, kept=Size.linear(1000))
    recompute = ModeCost(mode=Mode.RECOMPUTE, kept=Size.linear(100), transient=Size.linear(1000), extra_seconds=1.0)
    compress = ModeCost(mode=Mode.COMPRESS, kept=Size.linear(270), transient=Size.linear(100), extra_seconds=0.1)
    block = BlockCost(saved_bytes=1000, input_bytes=100, forward_seconds=1.0, modes=(store, recompute, compress))
    return Profile(blocks=(block,) * 4)


def test_the_planner_compresses_only_where_it_is_enabled_and_says_so() -> None:
    enabled = PlannerSession(profile_offering_compress(), budget_bytes=2500, config=ControllerConfig(margin_ratio=0))
    assert Mode.COMPRESS in enabled.plan.modes and enabled.plan.lossy
    assert "lossy" in enabled.plan.reason and "compress" in enabled.plan.reason
    without = ControllerConfig(margin_ratio=0, allowed_modes=frozenset({Mode.RECOMPUTE}))
    disabled = PlannerSession(profile_offering_compress(), budget_bytes=2500, config=without)
    assert Mode.COMPRESS not in disabled.plan.modes and not disabled.plan.lossy
    assert "lossy" not in disabled.plan.reason


def test_a_job_that_did_not_enable_compress_is_never_planned_to() -> None:
    model = tiny_model(d_model=64, seed=3)
    h = client.attach(model, budget_bytes=10**12)
    grads_after(model, h, seed=0)
    assert all(m.mode != Mode.COMPRESS for b in introspect.blocks(h) for m in (b.measure.modes if b.measure else ()))
    h.budget_bytes = 200_000  # tight: every block must keep less
    for seed in range(1, 4):
        grads_after(model, h, seed=seed)
    assert h.history and not any(p.lossy for p in h.history)
    assert Mode.COMPRESS not in h.modes
    h.close()


def test_the_new_mode_crosses_the_wire() -> None:
    compress = ModeCost(mode=Mode.COMPRESS, kept=Size.linear(3), transient=Size.linear(1), extra_seconds=0.5)
    block = BlockProfile(
        index=0,
        name="h.0",
        saved_bytes=10,
        input_bytes=1,
        forward_seconds=0.5,
        modes=(ModeCost(mode=Mode.STORE, kept=Size.linear(10)), compress),
    )
    hello = Hello(job_id="j", blocks=(block,), budget_bytes=100, profile_shape=Shape(batch=1, seq_len=4, tokens=4))
    assert wire.hello_from_pb(wire.hello_to_pb(hello)) == hello
    stats = StepStats(
        step=1,
        peak_allocated_bytes=5,
        mode_seconds=(ModeSeconds(Mode.COMPRESS, 1, 0.25, 0.5),),
        modes=(Mode.COMPRESS,),
    )
    assert wire.stats_from_pb(wire.stats_to_pb(stats)) == stats
    entry = ShapePlan(
        max_seq_len=4, max_tokens=4, modes=(Mode.COMPRESS,), predicted_peak_bytes=1, predicted_overhead_ratio=0.1
    )
    plan = Plan(
        version=1,
        blocks=(0,),
        checkpoint_every=0,
        predicted_peak_bytes=1,
        predicted_overhead_ratio=0.1,
        target_bytes=2,
        reason="lossy",
        modes=(Mode.COMPRESS,),
        shape_plans=(entry,),
    )
    assert wire.plan_from_pb(wire.plan_to_pb(plan)) == plan


def test_fsdp2_ranks_train_with_every_block_compressed(tmp_path: Path) -> None:
    for rank, steps in enumerate(run_ranks("fsdp_compress", tmp_path, world=2, config={})):
        _profiling, *pinned = steps
        for step in pinned:
            where = (rank, step)
            assert step["modes"] == [step["pinned"].upper()] * len(step["modes"]), where
            assert step["loss_equal"], "forward is untouched: the losses are plain FSDP2's"
            if step["pinned"] == "store":
                assert step["error"] == 0.0, where
            else:
                assert 0 < step["error"] <= 0.03 and step["cosine"] >= 0.999, where
        compressed = [s["saved_peak_bytes"] for s in pinned if s["pinned"] == "compress"]
        stored = [s["saved_peak_bytes"] for s in pinned if s["pinned"] == "store"]
        assert max(compressed) < min(stored), (rank, compressed, stored)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("format", ["int8", "fp8"])
def test_on_cuda_compressed_gradients_stay_close_and_restores_are_timed(format: str) -> None:
    model = tiny_model(d_model=128, seed=3).cuda()
    config = CompressConfig(format=format, min_bytes=1024)
    h = client.attach(model, budget_bytes=2**40, modes=ALL_COMPRESS, compress=config)
    data = batch(64, size=4, seed=9).cuda()
    lm_loss(model, data).backward()  # the profiling step
    h.step()
    model.zero_grad()
    grads = {}
    for mode in ("store", "compress"):
        h.pin_modes(mode)
        lm_loss(model, data).backward()
        h.step()
        grads[mode] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad()
    error, cosine = error_and_cosine(grads["compress"], grads["store"])
    assert 0 < error <= 0.03 and cosine >= 0.999, (error, cosine)
    h.flush()
    h.pin_modes("compress")
    lm_loss(model, data).backward()
    h.step()
    lm_loss(model, data).backward()
    h.step()
    torch.cuda.synchronize()
    assert h.last_stats is not None
    assert any(m.mode == Mode.COMPRESS and m.blocks > 0 for m in h.last_stats.mode_seconds)
    h.close()


def test_a_compress_plan_in_force_is_lossy_pinned_in_process_or_by_an_operator(tmp_path: Path) -> None:
    from .helpers import service_thread, train_step

    # In-process: a pin is the plan in force, priced, and lossy in its flag and its reason.
    model = tiny_model(d_model=64, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, budget_bytes=10**12, modes=ALL_COMPRESS, compress=SMALL, optimizer=opt)
    h.pin_modes("compress")
    assert h.plan.lossy and "not priced" in h.plan.reason  # before the profiling step
    for seed in range(3):
        train_step(model, opt, 32, seed=seed)
    assert h.modes == (Mode.COMPRESS,) * 4
    plan = h.plan
    assert plan.lossy and plan.modes == (Mode.COMPRESS,) * 4 and plan.predicted_peak_bytes > 0
    assert "pinned in the training process" in plan.reason and "lossy: blocks 0, 1, 2, 3" in plan.reason
    assert not any(p.lossy for p in h.history), "the planner's own plans stay as they were"
    h.pin_modes(None)
    train_step(model, opt, 32, seed=4)
    assert not h.plan.lossy and h.plan is h.history[-1]
    h.close()

    # Against a service: the REST API shows the modes the rank ran, lossy; an operator's pin is lossy too.
    with service_thread(tmp_path / "c.db") as bound:
        model = tiny_model(d_model=64, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(
            model, server=bound.grpc, job="pinned", budget_bytes=10**12, modes=ALL_COMPRESS, compress=SMALL,
            optimizer=opt,
        )  # fmt: skip
        h.pin_modes("compress")
        for seed in range(3):
            train_step(model, opt, 32, seed=seed)
        assert h.flush(10.0) and h.plan.lossy and h.plan.modes == (Mode.COMPRESS,) * 4
        url = f"http://{bound.http}/api/v1/jobs/pinned"
        job = httpx.get(url, timeout=10).json()
        assert job["in_force"]["lossy"] and job["in_force"]["source"] == "ranks", job["in_force"]
        assert job["in_force"]["modes"] == ["compress"] * 4 and job["ranks"][0]["modes"] == ["compress"] * 4
        h.pin_modes(None)
        pinned = httpx.post(f"{url}/pin", json={"modes": ["compress", "store", "store", "store"]}, timeout=10)
        assert pinned.status_code == 200, pinned.text
        # The pin comes with the answer to a step reported after it, and runs from the step boundary after that
        # answer arrives (a step or more later, by the stream's and the service's timing; on a loaded machine the
        # service's first plan may still be on its way, so the pin is told by its reason, not by a version).
        for seed in range(3, 40):
            train_step(model, opt, 32, seed=seed)
            if "pinned by an operator" in h.plan.reason and seed >= 5:
                break
        assert "pinned by an operator" in h.plan.reason, "the operator's pin never reached the rank"
        train_step(model, opt, 32, seed=40)  # a step that ran it, reported
        assert h.flush(10.0)
        job = httpx.get(url, timeout=10).json()
        assert job["in_force"]["source"] == "plan" and job["in_force"]["lossy"], job["in_force"]
        assert "pinned by an operator" in job["plan"]["reason"] and "lossy: blocks 0" in job["plan"]["reason"]
        assert h.plan.lossy and h.modes[0] == Mode.COMPRESS
        h.close()
