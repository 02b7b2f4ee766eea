"""Shared pieces of the tests: a tiny model, a training step, a live service."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.served import served
from rematd.client.demo.tiny_gpt import GPTConfig, TinyGPT, lm_loss


def tiny_model(n_layer: int = 4, d_model: int = 32, dropout: float = 0.0, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(n_layer=n_layer, d_model=d_model, n_head=2, max_seq_len=256, dropout=dropout))


def batch(seq: int, *, size: int = 2, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size, seq + 1), generator=gen)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seq: int, seed: int = 0) -> float:
    device = next(model.parameters()).device
    loss = lm_loss(model, batch(seq, seed=seed).to(device))
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
    with served(db, *args, timeout=timeout, env=env) as srv:
        yield LiveServer(grpc=srv.grpc, http=srv.http.removeprefix("http://"), db=db, proc=srv.proc)


@contextmanager
def service_thread(db: Path, **core: Any) -> Iterator[Any]:
    """A rematd service in this process, on loopback ports it picks, its core configured by ``core``
    (``CoreConfig``'s fields); its bound addresses (``.grpc``, ``.http``)."""
    from rematd.server import ServeConfig, ServiceThread
    from rematd.server.config import CoreConfig

    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(db), core=CoreConfig(**core)))
    svc.start()
    try:
        bound = svc.service.bound
        assert bound is not None
        yield bound
    finally:
        svc.stop()
