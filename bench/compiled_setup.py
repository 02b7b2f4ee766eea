"""What the compiled benchmarks share: the setup, its model and batches, and one measured training step.

``bench.compiled`` (the strategies) and ``bench.compiled_budget`` (rematd against ``torch.compile``'s own
budget) both build on it; neither imports the other's internals.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.common import gpt, tokens
from rematd import client
from rematd.client.demo.tiny_gpt import TinyGPT, lm_loss
from rematd.client.memory.accounting import SavedTensorAccounting


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """The model's size, the steps measured, and where and how it compiles."""

    n_layer: int
    d_model: int
    n_head: int
    seq: int
    batch: int
    steps: int
    warmup: int
    device: str
    backend: str
    bf16: bool


QUICK = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq": 16, "batch": 2, "steps": 4, "warmup": 3}
MID = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq": 128, "batch": 4, "steps": 6, "warmup": 3}
FULL = {"n_layer": 24, "d_model": 1024, "n_head": 16, "seq": 1024, "batch": 8, "steps": 10, "warmup": 6}
ADAPTIVE_LENGTHS = (256, 512, 768, 1024, 1536, 2048)
"""The sequence lengths the adaptive scenario draws from (on CUDA; scaled down on the CPU)."""


class Meter:
    """Step time and peak memory of one strategy's steps."""

    def __init__(self, setup: Setup, model: nn.Module, handle: client.Handle | None = None) -> None:
        self.setup = setup
        self.cuda = setup.device == "cuda"
        self.handle = handle
        self.acct = SavedTensorAccounting()
        self.acct.exclude_module_state(model)
        self.acct.active = True

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if self.cuda or self.handle is not None:
            yield  # rematd's own hooks count on the CPU; CUDA's allocator counts everything
        else:
            with self.acct.hooks():
                yield

    def peak(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated())
        if self.handle is not None and self.handle.last_stats is not None:
            return self.handle.last_stats.saved_peak_bytes
        return self.acct.take_peak()


def _autocast(setup: Setup) -> contextlib.AbstractContextManager[Any]:
    if setup.bf16:
        return torch.autocast(setup.device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def step(
    setup: Setup, model: nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor, meter: Meter
) -> tuple[float, int]:
    """One training step: its seconds and its peak."""
    start = time.perf_counter()
    with meter.measuring():
        with _autocast(setup):
            loss = lm_loss(model, data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if meter.handle is not None:
            meter.handle.step()
        if meter.cuda:
            torch.cuda.synchronize()
    return time.perf_counter() - start, meter.peak()


def build_model(setup: Setup) -> TinyGPT:
    """A fresh GPT of the setup's size on its device, its positions long enough for every adaptive length."""
    model = gpt(setup.n_layer, setup.d_model, setup.n_head, max_seq_len=max(setup.seq, max(ADAPTIVE_LENGTHS)))
    return model.to(setup.device)


def batch_of(setup: Setup, seq: int | None = None, seed: int = 0) -> torch.Tensor:
    """A batch of random tokens, ``seq`` long (the setup's own length by default)."""
    return tokens(setup.batch, seq or setup.seq, seed).to(setup.device)


def size_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that pick the model's size and the compiler's backend (read back by :func:`setup_of`)."""
    parser.add_argument("--quick", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--mid", action="store_true", help="a CPU-sized model: 4 blocks, d_model 128, batch 4 x 128")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--warmup", type=int, default=0, help="steps before measuring (default: the size's own)")


def setup_of(args: argparse.Namespace) -> Setup:
    """The setup :func:`size_arguments`' flags ask for: the full size on CUDA when there is one, else the CPU."""
    cuda = torch.cuda.is_available() and not (args.quick or args.mid)
    shape: dict[str, Any] = {**(QUICK if args.quick else MID if args.mid else FULL)}
    if args.warmup:
        shape["warmup"] = args.warmup
    return Setup(**shape, device="cuda" if cuda else "cpu", backend=args.backend, bf16=cuda)
