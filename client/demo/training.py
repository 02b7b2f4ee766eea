"""The demo's training: a small GPT trains on the CPU while its sequence length changes, a line per step
showing the plan tighten as sequences grow and loosen when they shrink (``rematd demo`` runs it against a
service)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rematd.client.attach import attach
from rematd.client.demo.tiny_gpt import GPTConfig, TinyGPT, lm_loss
from rematd.client.handle import Handle
from rematd.planner import checkpoint_every_of, letters

MiB = 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """The demo's workload."""

    steps: int = 240
    """Training steps in all."""
    short_seq: int = 64
    """Sequence length at the start and the end."""
    long_seq: int = 256
    """Sequence length in the third quarter (the second runs halfway between)."""
    batch: int = 8
    """Sequences per batch."""
    budget_mib: float = 48.0
    """Cap on activation memory (bytes saved for backward), MiB."""
    n_layer: int = 8
    """Decoder blocks."""
    d_model: int = 128
    """Model width."""
    seed: int = 0
    """Seed for the model and the data."""

    def seq_at(self, step: int) -> int:
        """Short, then twice as long, then long, then short again: a quarter of the run each."""
        quarter = max(1, self.steps // 4)
        phase = min(3, step // quarter)
        return (self.short_seq, (self.short_seq + self.long_seq) // 2, self.long_seq, self.short_seq)[phase]


def corpus() -> torch.Tensor:
    """Bytes of the client's own source: real text to learn, shipped with rematd."""
    client = Path(__file__).resolve().parents[1]
    text = b"".join(p.read_bytes() for p in sorted(client.rglob("*.py")))
    return torch.tensor(list(text), dtype=torch.long)


def batches(cfg: DemoConfig) -> Iterator[tuple[int, torch.Tensor]]:
    data = corpus()
    gen = torch.Generator().manual_seed(cfg.seed)
    for step in range(cfg.steps):
        seq = cfg.seq_at(step)
        starts = torch.randint(0, len(data) - seq - 1, (cfg.batch,), generator=gen)
        yield step, torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


def mode_letters(h: Handle) -> str:
    """The modes in force, one letter a block."""
    return letters(h.modes)


def checkpoint_every(h: Handle) -> str:
    """k when the modes in force recompute every k-th block (and store the rest), else "-"."""
    k = checkpoint_every_of(h.modes)
    return str(k) if k else "-"


def _mib(n: int) -> str:
    return f"{n / MiB:7.1f}"


def train(
    cfg: DemoConfig,
    *,
    server: str | None,
    job: str,
    sync: bool = False,
    out: Callable[[str], None] = print,
) -> Handle:
    """Run the demo's training loop; returns the (closed) handle."""
    torch.manual_seed(cfg.seed)
    model = TinyGPT(GPTConfig(n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=4, max_seq_len=cfg.long_seq))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    # In-process the demo plans on the training thread: its printout is then the same plan, step for step, run after
    # run (a served demo's plans come from the service).
    budget = int(cfg.budget_mib * MiB)
    h = attach(model, server=server, job=job, budget_bytes=budget, optimizer=opt, planner_thread=server is not None)
    out(
        "modes per block: . store, m MLP recomputed, a attention recomputed, s selective (recompute pointwise ops), "
        "t torchtitan's selective, R recompute, O offload to host"
    )
    out("every: the checkpoint frequency k when every k-th block recomputes, - when the modes are not that")
    out(
        f"{'step':>5} {'seq':>5} {'modes':>{max(8, cfg.n_layer)}} {'plan':4} {'pred MiB':>8} {'peak MiB':>8}"
        f" {'budget':>7} {'every':>5} {'sec':>6} loss"
    )
    try:
        for step, batch in batches(cfg):
            t0 = time.perf_counter()
            loss = lm_loss(model, batch)
            plan = h.plan  # the plan is swapped in at the forward's start, so read it after
            modes = mode_letters(h)
            every = checkpoint_every(h)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sync:
                h.flush(10.0)
            stats = h.last_stats
            peak = stats.saved_peak_bytes if stats else 0
            predicted = next((e.predicted_peak_bytes for e in plan.shape_plans if e.covers(h.last_shape)), None)
            out(
                f"{step:5d} {batch.shape[1] - 1:5d} {modes:>{max(8, cfg.n_layer)}} v{plan.version:<3d}"
                f" {_mib(predicted if predicted is not None else plan.predicted_peak_bytes):>8}"
                f" {_mib(peak):>8} {_mib(h.budget_bytes or 0):>7} {every:>5}"
                f" {time.perf_counter() - t0:6.3f} {loss.item():.3f}"
            )
    finally:
        h.close()
    return h
