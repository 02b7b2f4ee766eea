from __future__ import annotations

import pytest
import torch

from rematd.client.memory import CudaMemory
from rematd.records import MEMORY_CUDA


class FakeCuda:
    """Stands in for the CUDA runtime at torch's boundary: the allocator's counters."""

    def __init__(self) -> None:
        self.peak = 700
        self.resets = 0

    def memory_stats(self, device: object) -> dict[str, int]:
        return {
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.peak": 900,
            "allocated_bytes.all.current": 300,
            "reserved_bytes.all.current": 800,
            "num_alloc_retries": 2,
            "num_ooms": 1,
        }

    def reset_peak_memory_stats(self, device: object) -> None:
        self.resets += 1
        self.peak = 300

    def mem_get_info(self, device: object) -> tuple[int, int]:
        return (1000, 4000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the CUDA boundary; the GPU test covers real CUDA")
def test_cuda_source_reads_and_resets_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda()
    for name in ("memory_stats", "reset_peak_memory_stats", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 123)
    source = CudaMemory(torch.device("cuda", 0))
    assert source.kind == MEMORY_CUDA and source.name == "Fake GPU" and source.total_bytes == 4000
    assert source.static_bytes() == 123
    fake.peak = 700
    sample = source.sample()
    assert sample.peak_allocated_bytes == 700 and sample.peak_reserved_bytes == 900
    assert (sample.alloc_retries, sample.oom_count, sample.free_bytes, sample.total_bytes) == (2, 1, 1000, 4000)
    assert fake.resets == 2, "peaks are reset at start and after every sample"
    assert source.sample().peak_allocated_bytes == 300


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_source_on_a_real_gpu() -> None:
    source = CudaMemory(torch.device("cuda", 0))
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    sample = source.sample()
    assert sample.peak_allocated_bytes >= x.numel()
    assert 0 < sample.free_bytes <= sample.total_bytes
