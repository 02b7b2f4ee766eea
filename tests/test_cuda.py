"""rematd on a real GPU: the CUDA allocator as the memory source, plans held under a device budget,
every mode (offload included) computing what plain training computes, and a real out-of-memory
error recovered from. Skipped without CUDA; the CPU paths have their own tests."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.client.demo.tiny_gpt import GPTConfig, TinyGPT, lm_loss
from rematd.client.memory.sources import CudaMemory
from rematd.planner import Mode, Shape, predict_peak_bytes

from .helpers import live_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ALL = [Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE, Mode.OFFLOAD]


def gpt(n_layer: int = 4, d_model: int = 256, dropout: float = 0.0, seed: int = 0, max_seq: int = 2048) -> TinyGPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=n_layer, d_model=d_model, n_head=4, max_seq_len=max_seq, dropout=dropout)
    return TinyGPT(cfg).cuda()


def data(seq: int, batch: int = 4, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq + 1), generator=gen).cuda()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seq: int, seed: int = 0) -> float:
    loss = lm_loss(model, data(seq, seed=seed))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def test_the_handle_reads_the_cuda_allocator() -> None:
    model = gpt()
    opt = torch.optim.AdamW(model.parameters())
    h = client.attach(model, optimizer=opt, budget_bytes=2**40, modes=ALL)
    for i in range(3):
        train_step(model, opt, 256, i)
    assert isinstance(introspect.cycle(h).memory, CudaMemory)
    m = h.last_memory
    assert m is not None and m.peak_allocated_bytes > m.allocated_bytes > 0
    assert m.peak_reserved_bytes >= m.peak_allocated_bytes and 0 < m.free_bytes <= m.total_bytes
    assert h.last_stats is not None and h.last_stats.static_bytes > 0, "weights and optimizer state at step start"
    assert Mode.OFFLOAD in {mc.mode for mc in introspect.hello(h).blocks[0].modes}, "a host link: offload offered"
    h.close()


@pytest.mark.parametrize("mode", ALL, ids=lambda m: m.name.lower())
def test_every_mode_computes_what_plain_training_computes(mode: Mode) -> None:
    ref = gpt(dropout=0.1, seed=3)
    model = gpt(dropout=0.1, seed=3)
    h = client.attach(model, budget_bytes=2**40)
    lm_loss(model, data(128)).backward()  # the profiling step
    h.step()
    model.zero_grad()
    h.pin_modes(mode)
    for seed in (1, 2):
        torch.manual_seed(seed)
        ref_loss = lm_loss(ref, data(128, seed=seed))
        ref_loss.backward()
        torch.manual_seed(seed)
        loss = lm_loss(model, data(128, seed=seed))
        loss.backward()
        h.step()
        # The checkpoint restores the CUDA RNG for dropout; only atomics in backward kernels may differ.
        assert torch.allclose(loss, ref_loss, rtol=0, atol=0)
        for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), f"{mode.name}: {name}"
        ref.zero_grad()
        model.zero_grad()
    assert all(m == mode for m in h.modes)
    h.close()


def test_plans_hold_the_allocators_peak_under_the_budget_as_lengths_change() -> None:
    model = gpt(n_layer=8, d_model=512)
    opt = torch.optim.AdamW(model.parameters())
    probe = client.attach(model, optimizer=opt, budget_bytes=2**40)
    peaks = {}
    train_step(model, opt, 512)  # the profiling step recomputes every block
    for seq in (512, 2048):
        train_step(model, opt, seq)
        assert probe.last_memory is not None
        peaks[seq] = probe.last_memory.peak_allocated_bytes
    probe.close()
    del model, opt
    torch.cuda.empty_cache()
    # Room for storing everything at 512 tokens, not at 2048.
    budget = int(peaks[512] + 0.4 * (peaks[2048] - peaks[512]))
    model = gpt(n_layer=8, d_model=512)
    opt = torch.optim.AdamW(model.parameters())
    h = client.attach(model, optimizer=opt, budget_bytes=budget)
    train_step(model, opt, 512)  # the profiling step
    over = []
    for i, seq in enumerate([512] * 5 + [2048] * 10 + [1024] * 5 + [512] * 10):
        train_step(model, opt, seq, seed=i)
        assert h.last_memory is not None
        if h.last_memory.peak_allocated_bytes > budget:
            over.append((i, seq, h.last_memory.peak_allocated_bytes))
    assert not over, f"steps over the budget of {budget}: {over}"
    assert any(m != Mode.STORE for p in h.history for e in p.shape_plans for m in e.modes if e.max_seq_len >= 2048)
    assert all(m == Mode.STORE for m in h.modes), "back at 512 tokens the plan stores everything again"
    h.close()


def test_a_real_out_of_memory_error_is_recovered_from() -> None:
    model = gpt(n_layer=8, d_model=512, max_seq=4096)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    h = client.attach(model, optimizer=opt, budget_bytes=2**40)  # the planner sees room: only the device says no
    train_step(model, opt, 256)
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    profile = introspect.hello(h).profile()
    long = Shape(batch=4, seq_len=4096, tokens=4 * 4096)
    store_all = predict_peak_bytes(profile, frozenset(), shape=long)
    # A cap on this process's share of the device: half of what storing everything at 4096 tokens saves.
    torch.cuda.set_per_process_memory_fraction((static + store_all // 2) / torch.cuda.mem_get_info()[1])
    try:
        loss = h.run_step(train_step, model, opt, 4096, 1)
        assert loss == loss  # not NaN: the retried step ran
        assert h.oom_count == 1 and h.safe_mode, "the first try ran out of memory; the retry recomputed every block"
        assert h.flush(10.0)
        train_step(model, opt, 4096, 2)
        assert h.oom_count == 1 and not h.safe_mode, "the planner's tighter plan took over, and held"
        assert any(m != Mode.STORE for m in h.modes)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        h.close()


def _lean_and_stored(seq: int) -> tuple[int, int]:
    """The allocator's peak of a step with every block recomputed (the profiling step's) and with every block
    stored, after the optimizer made its state."""
    model = gpt(n_layer=8, d_model=512)
    opt = torch.optim.AdamW(model.parameters())
    probe = client.attach(model, optimizer=opt, budget_bytes=2**40)
    peaks = {}
    train_step(model, opt, seq)  # the profiling step
    for mode in ("recompute", "store"):
        probe.pin_modes(mode)
        train_step(model, opt, seq)
        assert probe.last_memory is not None
        peaks[mode] = probe.last_memory.peak_allocated_bytes
    probe.close()
    del model, opt
    torch.cuda.empty_cache()
    return peaks["recompute"], peaks["store"]


@pytest.mark.parametrize("served", [False, True], ids=["in-process", "served"])
def test_a_model_that_fits_only_checkpointed_trains_in_a_plain_loop_from_its_first_step(
    served: bool, tmp_path: Path
) -> None:
    lean, stored = _lean_and_stored(1024)
    assert stored > 1.3 * lean, "storing every block must not fit"
    budget = int(1.05 * lean)
    # The device itself holds the budget (with room for the caching allocator's rounding): a step over it raises,
    # and this plain loop (no run_step) would die with it.
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, 1.1 * budget / total))
    try:
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(live_server(tmp_path)).grpc if served else None
            model = gpt(n_layer=8, d_model=512)
            opt = torch.optim.AdamW(model.parameters())
            h = client.attach(model, optimizer=opt, budget_bytes=budget, server=server, job="cuda-tight")
            for i in range(10):
                train_step(model, opt, 1024, i)
                if served:
                    assert h.flush(20.0)
                assert h.last_memory is not None
                assert h.last_memory.peak_allocated_bytes <= budget, (i, h.last_memory.peak_allocated_bytes, budget)
            assert h.oom_count == 0
            assert all(p.predicted_peak_bytes <= budget for p in h.history), [p.reason for p in h.history]
            h.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _offloading(config: client.OffloadConfig, seed: int = 3) -> tuple[TinyGPT, TinyGPT, client.Handle]:
    ref = gpt(dropout=0.1, seed=seed)
    model = gpt(dropout=0.1, seed=seed)
    h = client.attach(model, budget_bytes=2**40, modes=ALL, offload=config)
    lm_loss(model, data(128)).backward()  # the profiling step
    h.step()
    model.zero_grad()
    h.pin_modes(Mode.OFFLOAD)
    return ref, model, h


def _same_step(ref: TinyGPT, model: TinyGPT, h: client.Handle, seed: int, before_backward: Any = None) -> None:
    torch.manual_seed(seed)
    ref_loss = lm_loss(ref, data(128, seed=seed))
    ref_loss.backward()
    torch.manual_seed(seed)
    loss = lm_loss(model, data(128, seed=seed))
    if before_backward is not None:
        before_backward()
    loss.backward()
    torch.cuda.synchronize()  # the step's timing events complete before its end: its statistics hold them
    h.step()
    assert torch.equal(loss, ref_loss)
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
    ref.zero_grad()
    model.zero_grad()


def test_offload_copies_into_pinned_buffers_reused_step_after_step() -> None:
    ref, model, h = _offloading(client.OffloadConfig(prefetch_blocks=2))
    pool = introspect.offloader(h).pool
    assert pool is not None
    fresh = []
    for seed in (1, 2, 3, 4):
        _same_step(ref, model, h, seed)
        fresh.append(pool.fresh)
    assert fresh[0] > 0 and fresh[-1] == fresh[0], f"the first offloading step allocates, the rest reuse: {fresh}"
    assert pool.reused >= 3 * fresh[0]
    assert all(b.is_pinned() for free in pool._free.values() for b, _ in free), "pinned: asynchronous copies"
    off = introspect.offloader(h)
    assert off.late == 0 and off.prefetched > 0
    h.close()


def test_a_step_whose_copies_back_come_late_waits_for_them_and_computes_the_same() -> None:
    """The side stream held up behind a long kernel: backward's unpack waits on each copy's event (timed as
    offload's cost) instead of reading a buffer still being written."""
    ref, model, h = _offloading(client.OffloadConfig(prefetch_blocks=0))
    off = introspect.offloader(h)
    _same_step(ref, model, h, 1)

    def hold_up_the_copies() -> None:
        for stream in off._streams.values():
            with torch.cuda.stream(stream):
                torch.cuda._sleep(200_000_000)  # some 0.1 s of a spinning kernel ahead of every copy back

    _same_step(ref, model, h, 2, hold_up_the_copies)
    assert h.last_stats is not None
    (timed,) = [m for m in h.last_stats.mode_seconds if m.mode == Mode.OFFLOAD]
    assert timed.seconds > 0.01, f"the wait for the late copies is offload's cost: {timed}"
    h.close()
