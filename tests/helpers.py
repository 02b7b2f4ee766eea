"""Shared pieces of the tests: a tiny model, a training step, a live service."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.served import addresses
from rematd.client.models import GPTConfig, TinyGPT, lm_loss


def tiny_model(n_layer: int = 4, d_model: int = 32, dropout: float = 0.0, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(n_layer=n_layer, d_model=d_model, n_head=2, max_seq_len=256, dropout=dropout))


def batch(seq: int, *, size: int = 2, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size, seq + 1), generator=gen)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seq: int, seed: int = 0) -> float:
    loss = lm_loss(model, batch(seq, seed=seed))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


@dataclass
class LiveServer:
    grpc: str
    http: str
    db: Path
    proc: subprocess.Popen[str]

    @property
    def url(self) -> str:
        return f"http://{self.http}"


@contextmanager
def live_server(
    tmp: Path, timeout: float = 60.0, *, args: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Iterator[LiveServer]:
    """A real ``rematd serve`` process on loopback (unless ``args`` say otherwise), on ports it picks itself."""
    db = tmp / "rematd.db"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    command = [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0"]
    proc = subprocess.Popen(
        [*command, "--db", str(db), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        grpc_addr, http_addr = addresses(proc, timeout)
        yield LiveServer(grpc=grpc_addr, http=http_addr, db=db, proc=proc)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str], grace: float = 15) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it lingers past ``grace`` seconds; closes its output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()
