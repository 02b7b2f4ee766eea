"""``rematd demo``: a small GPT trains on the CPU while its sequence length changes.

The client streams to a rematd service (in-process unless ``--server`` names
one) and a line per step shows the plan tighten as sequences grow and loosen
when they shrink.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rematd.client.attach import attach
from rematd.client.handle import Handle
from rematd.client.models import GPTConfig, TinyGPT, lm_loss
from rematd.planner import Mode, blocks_of, frequency_of, letters

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
    """Bytes of this package's own source: real text to learn, shipped with rematd."""
    here = Path(__file__).resolve().parent
    text = b"".join(p.read_bytes() for p in sorted(here.glob("*.py")))
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
    modes = h.modes
    if any(m not in (Mode.STORE, Mode.RECOMPUTE) for m in modes):
        return "-"
    k = frequency_of(len(modes), blocks_of(modes))
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
    h = attach(model, server=server, job=job, budget_bytes=int(cfg.budget_mib * MiB), optimizer=opt)
    out("modes per block: . store, s selective (recompute pointwise ops), R recompute, O offload to host")
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


def _parser() -> argparse.ArgumentParser:
    # The module's docstring without its reStructuredText markup: --help is read in a terminal.
    parser = argparse.ArgumentParser(prog="rematd demo", description=(__doc__ or "").replace("``", ""))
    parser.add_argument("--server", help="host:port of a running rematd service (default: start one in-process)")
    parser.add_argument("--no-serve", action="store_true", help="exit when training ends instead of serving")
    workload = {f.name: f.default for f in dataclasses.fields(DemoConfig)}
    parser.add_argument("--steps", type=int, default=workload["steps"], help="training steps (%(default)s)")
    parser.add_argument(
        "--budget-mib", type=float, default=workload["budget_mib"], help="activation budget, MiB (%(default)s)"
    )
    parser.add_argument(
        "--http-port", type=int, help="dashboard port of the in-process service (default: rematd serve's)"
    )
    parser.add_argument("--db", help="SQLite file of the in-process service (default: a temporary one)")
    parser.add_argument(
        "--job",
        default="demo",
        help="the job's name on the service and its dashboard (%(default)s); a name used before continues its "
        "plan history",
    )
    parser.add_argument(
        "--sync", action="store_true", help="wait for the service's answer after each step (repeatable runs)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3")
    if args.budget_mib <= 0:
        parser.error("--budget-mib must be positive")
    cfg = DemoConfig(steps=args.steps, budget_mib=args.budget_mib)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.server:
        train(cfg, server=args.server, job=args.job, sync=args.sync)
    else:
        _with_service(cfg, args)
    return 0


def _with_service(cfg: DemoConfig, args: argparse.Namespace) -> None:
    """Train against a service started in this process, then serve its dashboard until Ctrl-C."""
    from rematd.server.app import ServeConfig, ServiceThread

    tmp = tempfile.TemporaryDirectory(prefix="rematd-demo-")
    db = args.db or str(Path(tmp.name) / "rematd.db")
    try:
        port = {} if args.http_port is None else {"http_port": args.http_port}
        service = ServiceThread(ServeConfig(grpc_port=0, db=db, **port))
        bound = service.start()
    except OSError:  # the default dashboard port is taken: any free one
        service = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=db))
        bound = service.start()
    print(f"rematd service: gRPC {bound.grpc}, dashboard {bound.dashboard}, store {bound.db}")
    try:
        train(cfg, server=bound.grpc, job=args.job, sync=args.sync)
        print(f"\ndashboard: {bound.dashboard}   plans: http://{bound.http}/api/v1/jobs/{args.job}/plans")
        if not args.no_serve:
            print("serving until Ctrl-C")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
    finally:
        service.stop()
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
