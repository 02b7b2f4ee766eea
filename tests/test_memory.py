from __future__ import annotations

import pytest
import torch

from rematd.client import introspect
from rematd.client.memory.sources import CudaMemory, outside_blocks
from rematd.planner import Mode, Shape, Size, Term
from rematd.planner.messages import MEMORY_CUDA


class FakeCuda:
    """Stands in for the CUDA runtime at torch's boundary: the allocator's counters."""

    def __init__(self) -> None:
        self.peak = 700
        self.resets = 0

    def memory_stats_as_nested_dict(self, device: object) -> dict[str, object]:
        return {
            "allocated_bytes": {"all": {"peak": self.peak, "current": 300}, "small_pool": {"peak": 1}},
            "reserved_bytes": {"all": {"peak": 900, "current": 800}},
            "num_alloc_retries": 2,
            "num_ooms": 1,
            "inactive_split_bytes": {"all": {"current": 64}},
        }

    def reset_peak_memory_stats(self, device: object) -> None:
        self.resets += 1
        self.peak = 300

    def mem_get_info(self, device: object) -> tuple[int, int]:
        return (1000, 4000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the CUDA boundary; the GPU test covers real CUDA")
def test_cuda_source_reads_and_resets_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda()
    for name in ("memory_stats_as_nested_dict", "reset_peak_memory_stats", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Fake GPU")
    flattened = []
    # What the step's start reads comes from the nested statistics, as the sample's: never torch's flattening.
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: flattened.append(device) or {})
    source = CudaMemory(torch.device("cuda", 0))
    assert source.kind == MEMORY_CUDA and source.name == "Fake GPU" and source.total_bytes == 4000
    assert source.static_bytes() == 300 and not flattened
    fake.peak = 700
    sample = source.sample()
    assert sample.peak_allocated_bytes == 700 and sample.peak_reserved_bytes == 900
    assert (sample.alloc_retries, sample.oom_count, sample.free_bytes, sample.total_bytes) == (2, 1, 1000, 4000)
    assert sample.inactive_split_bytes == 64
    assert fake.resets == 2, "peaks are reset at start and after every sample"
    assert source.sample().peak_allocated_bytes == 300


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_source_on_a_real_gpu() -> None:
    source = CudaMemory(torch.device("cuda", 0))
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    sample = source.sample()
    assert sample.peak_allocated_bytes >= x.numel()
    assert 0 < sample.free_bytes <= sample.total_bytes


class ReportsCuda(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device: what the handle reads to pick the CUDA allocator.

    Its ops run on the CPU and return plain tensors, so only the model's input says CUDA.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the CUDA boundary; the GPU test covers real CUDA")
def test_a_cuda_model_reports_allocator_figures_every_step_and_recovers_from_cuda_oom(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handle picks the CUDA source for a model fed CUDA tensors and samples it once per step."""
    from rematd import client

    fake = FakeCuda()
    for name in ("memory_stats_as_nested_dict", "reset_peak_memory_stats", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Fake GPU")
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    # The blocks' inputs are plain CPU tensors: only the memory source sees a CUDA device. Measuring the
    # host link for offload then fails (a CPU build has no CUDA to copy from), which must only drop offload.
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), *(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(3))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = client.attach(model, optimizer=opt, blocks=list(model)[1:])
    calls = 0

    def step() -> None:
        nonlocal calls
        calls += 1
        loss = model(torch.randn(2, 4).as_subclass(ReportsCuda)).sum()
        fake.peak = 500 + calls  # what the allocator saw during this step
        loss.backward()
        if calls == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        opt.step()
        opt.zero_grad()

    h.run_step(step)
    assert h.last_stats is not None and h.last_stats.peak_allocated_bytes == 501
    assert h.last_memory is not None and h.last_memory.inactive_split_bytes == 64
    assert h.budget_bytes == 4000, "the default budget is the device's capacity"
    offered = {m.mode for b in introspect.blocks(h) if b.measure for m in b.measure.modes}
    assert h.plan.version == 0 and offered, "the profile completed"
    assert Mode.OFFLOAD not in offered and Mode.RECOMPUTE in offered
    h.run_step(step)  # fails once, is retried with every block recomputed
    assert calls == 3 and h.oom_count == 1 and emptied, "the cache was emptied after the error"
    assert introspect.accounting(h).active is False, "no saved-tensor hooks on CUDA"
    h.close()


class WideMLP(torch.nn.Module):
    """A residual block whose hidden layer dwarfs its input: what a recompute brings back dwarfs what it keeps."""

    def __init__(self, width: int = 16, hidden: int = 512) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, hidden)
        self.fc2 = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def saved_bytes_of(block: torch.nn.Module, x: torch.Tensor) -> int:
    """What one forward of ``block`` saves for backward (parameters aside), by torch's own hooks:
    what its recompute in backward brings back."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        type(block).forward(block, x)  # the block's own forward, not the checkpointing one rematd put in place
    return sum(seen.values())


def test_cpu_peak_counts_what_a_recomputed_block_rematerialises_in_backward() -> None:
    from rematd import client

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(WideMLP() for _ in range(4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, blocks=list(model), optimizer=opt, budget_bytes=10**12, modes=["recompute"])
    x = torch.randn(4, 8, 16)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the profile
    h.pin_modes(["recompute"] * 4)
    step()
    step()
    assert h.modes == (Mode.RECOMPUTE,) * 4 and h.last_stats is not None
    # When the last block recomputes, every block's input is still kept for its own recompute.
    kept = 4 * x.untyped_storage().nbytes()
    transient = saved_bytes_of(model[3], x.detach().requires_grad_())
    assert transient > 10 * kept // 4, "the test needs the transient to dominate"
    measured = h.last_stats.saved_peak_bytes
    assert kept + 0.9 * transient <= measured <= 1.1 * (kept + transient), (measured, kept, transient)
    h.close()


def test_what_the_profiling_step_creates_and_keeps_is_not_modelled_as_growing_with_tokens() -> None:
    # Static 1000 at the start; blocks saved 300; the step created 100 of gradients (params had none)
    # and 200 of optimizer state, all still allocated at its end; 50 of logits at the peak.
    size = outside_blocks(peak=1650, static=1000, blocks=300, allocated_after=1300, fresh_grads=100)
    assert size == Size((Term(100, 0, 0), Term(50, 1, 1))), "gradients constant, the state out, logits grow"
    at = Shape(batch=2, seq_len=16, tokens=32)
    doubled = Shape(batch=2, seq_len=32, tokens=64)
    assert size.at(at, doubled) == 100 + 100
    # Nothing kept (a later step, or an optimizer with no state): the rest grows with tokens as before.
    assert outside_blocks(peak=1650, static=1000, blocks=300, allocated_after=1100, fresh_grads=100) == Size(
        (Term(100, 0, 0), Term(250, 1, 1))
    )
    # The allocator freed more than it kept, or the peak was under static plus blocks: never negative.
    assert outside_blocks(peak=1200, static=1000, blocks=300, allocated_after=900, fresh_grads=100) == Size(())
    assert outside_blocks(peak=1450, static=1000, blocks=300, allocated_after=1900, fresh_grads=100) == Size(
        (Term(100, 0, 0),)
    )
