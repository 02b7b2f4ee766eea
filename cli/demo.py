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
from pathlib import Path

import torch

from rematd.client.demo.training import DemoConfig, train


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
        "--sync", action="store_true", help="wait for the planner's answer after each step (repeatable runs)"
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
    # The service only when the demo starts one: --server needs the client alone.
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
    # With --no-serve the service stops with the training: no address is printed that will not answer.
    store = f"store {bound.db}" if args.db else "a temporary store"
    shown = "" if args.no_serve else f", dashboard {bound.dashboard}"
    print(f"rematd service: gRPC {bound.grpc}{shown}, {store}")
    try:
        train(cfg, server=bound.grpc, job=args.job, sync=args.sync)
        if args.no_serve:
            print("\nservice stopped" + (f"; plans kept in {bound.db}" if args.db else ""))
        else:
            print(f"\ndashboard: {bound.dashboard}   plans: http://{bound.http}/api/v1/jobs/{args.job}/plans")
            print("serving until Ctrl-C")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
    finally:
        service.stop()
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
