"""Load curve of ``rematd serve``: simulated ranks on real gRPC streams, a step a second each.

Starts a ``rematd serve`` subprocess on loopback, then load-generator
processes that each hold many ranks (``bench.load_gen``: asyncio, grpc.aio,
many streams per channel), growing the number of ranks level by level. Each
rank ends a step every ``--interval`` seconds and reports as the rematd client
does: every step at first, then, once the service's acks allow it (the plan has
held, no risk), its steady steps folded into one report per report interval
(``--no-fold``: every step regardless). At each level, after a settle, for a
bounded time, it measures the time from sending a report to reading its ack,
how stale the service's view of any rank got, the server's CPU (all its
processes) and its memory per rank (``bench.load_server``). Prints a table as
it goes, then the curve as a Markdown table, and writes JSON
(``bench.load_report``).

    .venv/bin/python -m bench.load --ranks 1000,5000,10000 --seconds 20 --workers 2
    .venv/bin/python -m bench.load --ranks 5000,10000 --to-limit   # on until a level misses the p99 target
    .venv/bin/python -m bench.load --postgres --replicas 2 --workers 1 --ranks 1000,2000   # a fleet (bench.load_fleet)

The generator runs on the same machine and takes CPU from the server, so it
measures itself too: its CPU, how late each scheduled report was sent
(``lag``: scheduled step end to the write) and how late its event loop woke
from a 10 ms sleep (``loop``). A generator that keeps up sends within a few
milliseconds of schedule; when it does not, its lag is in the latency too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.load_fleet import Database, FleetWindow, database_arg, fleet_target
from bench.load_gen import GROW_SECONDS, client_process
from bench.load_probe import DIR_ENV, read_windows
from bench.load_report import (
    Level,
    Targets,
    fleet_markdown,
    level_of,
    markdown,
    print_header,
    print_row,
    summary,
)
from bench.load_server import Server, proc_tree, rss_bytes, start_server

MAX_RANKS = 100_000


def _recv(conn: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"a load generator did not answer {what} within {timeout:g} s")
    return conn.recv()[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1000,5000,10000", help="comma-separated levels of ranks")
    p.add_argument(
        "--to-limit",
        action="store_true",
        help="after the listed levels, add --limit-step ranks a level until one misses the p99 target (or fails)",
    )
    p.add_argument("--limit-step", type=int, default=5000, help="ranks added a level with --to-limit (5000)")
    p.add_argument("--limit-max", type=int, default=40_000, help="the highest level --to-limit tries (40000)")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per level (after a settle)")
    p.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="seconds at a level before measuring (new ranks report every step for their first 16)",
    )
    p.add_argument("--workers", type=int, default=2, help="server worker processes (--workers of rematd serve)")
    p.add_argument("--clients", type=int, default=2, help="load-generator processes")
    p.add_argument("--replicas", type=int, default=1, help="rematd serve processes on one store (needs --postgres)")
    p.add_argument("--postgres", action="store_true", help="the store is a throw-away local PostgreSQL cluster")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between a rank's steps (1: 1 Hz)")
    p.add_argument(
        "--report-interval",
        type=float,
        default=10.0,
        help="the service's --max-report-interval-seconds: how long a steady rank may fold its steps (10)",
    )
    p.add_argument("--no-fold", action="store_true", help="ranks report every step whatever the service allows")
    p.add_argument("--p99-ms", type=float, default=50.0, help="the p99 latency a level must stay under")
    p.add_argument(
        "--kib-per-rank", type=float, default=30.0, help="the server memory per rank a level must stay under"
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="watch the server's event loops (bench.load_probe): their lateness, collections, and what held them",
    )
    p.add_argument("--out", default="artifacts/load.json")
    return p


def _levels(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The levels to run: those listed, then (``--to-limit``) the ones a limit search may reach."""
    try:
        levels = [int(x) for x in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks must be comma-separated whole numbers, got {args.ranks!r}")
    if any(n < 1 for n in levels) or levels != sorted(levels) or levels[-1] > MAX_RANKS:
        p.error(f"ranks must be ascending, in 1-{MAX_RANKS}")
    if args.to_limit:
        if args.limit_step < 1:
            p.error("limit-step must be >= 1")
        if not levels[-1] <= args.limit_max <= MAX_RANKS:
            p.error(f"limit-max must be in {levels[-1]}-{MAX_RANKS}")
        while levels[-1] + args.limit_step <= args.limit_max:
            levels.append(levels[-1] + args.limit_step)
    return levels


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 1 <= args.seconds <= 120:
        p.error("seconds must be in 1-120 (the run is bounded)")
    if not 0 <= args.settle <= 120:
        p.error("settle must be in 0-120 (the run is bounded)")
    if not 1 <= args.clients <= 16 or not 1 <= args.workers <= 16:
        p.error("clients and workers must be in 1-16")
    if not 0.01 <= args.interval <= 60:
        p.error("interval must be in 0.01-60 seconds")
    if not 1 <= args.replicas <= 8:
        p.error("replicas must be in 1-8")
    if args.replicas > 1 and not args.postgres:
        p.error("replicas > 1 share one store: add --postgres (SQLite has one writer)")


def _start_clients(args: argparse.Namespace, target: str, deadline: float) -> tuple[list[Any], list[Any]]:
    ctx = mp.get_context("spawn")
    pipes: list[Any] = []
    procs: list[Any] = []
    for i in range(args.clients):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=client_process,
            args=(target, child, i, args.interval, not args.no_fold, deadline),
            daemon=True,
        )
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    return pipes, procs


def _stop_clients(pipes: list[Any], procs: list[Any]) -> None:
    for conn in pipes:
        with contextlib.suppress(OSError):
            conn.send(("stop", None))
    for proc in procs:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _run_level(
    n: int, args: argparse.Namespace, servers: list[Server], pipes: list[Any], *, base_rss: int, failed_before: int,
    targets: Targets, probe: Path | None, database: Database | None,
) -> tuple[Level, list[dict[str, Any]], int]:  # fmt: skip
    """Grow to ``n`` ranks, settle, measure; the level, what each generator sent, and the failures so far."""
    share = [n // args.clients + (1 if i < n % args.clients else 0) for i in range(args.clients)]
    for conn, want in zip(pipes, share, strict=True):
        conn.send(("grow", want))
    t_grow = time.monotonic()
    for conn in pipes:
        _recv(conn, GROW_SECONDS + 30, "grow")
    ramp = time.monotonic() - t_grow
    time.sleep(args.settle)
    window = FleetWindow([s.proc.pid for s in servers], database, signal_processes=probe is not None)
    for conn in pipes:
        conn.send(("measure", args.seconds))
    got = [_recv(conn, args.seconds + 30, "measure") for conn in pipes]
    usage, by_replica, store = window.close()
    probed = None
    if probe is not None:
        time.sleep(1.0)  # each process writes its window when its loop next runs
        probed = read_windows(probe)
    failed = sum(g["failed"] for g in got)
    level = level_of(
        ranks=n, seconds=args.seconds, ramp=ramp, got=got, failed_streams=failed - failed_before,
        base_rss=base_rss, usage=usage, targets=targets, probed=probed,
    )  # fmt: skip
    if len(servers) > 1:
        level.replica_cores = by_replica
    if store is not None:
        level.store_rows_per_s, level.store_commits_per_s = store.rows_per_s, store.commits_per_s
        level.store_cpu_cores = store.cores
    return level, got, failed


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    levels = _levels(p, args)
    _check(p, args)
    longest = args.interval if args.no_fold else max(args.interval, args.report_interval)
    targets = Targets(p99_ms=args.p99_ms, kib_per_rank=args.kib_per_rank, longest_quiet_s=longest + args.interval)
    budget = len(levels) * (GROW_SECONDS + 30 + args.settle + args.seconds + 30) + 60
    tmp = Path(tempfile.mkdtemp(prefix="rematd-load-"))
    probe = tmp / "probe" if args.probe else None
    database = Database() if args.postgres else None
    servers: list[Server] = []
    try:
        servers = _start_servers(args, tmp, probe, database)
        results = _run(args, levels, targets, servers, budget, probe, database)
    finally:
        for server in servers:
            server.stop()
        if database is not None:
            database.remove()
        shutil.rmtree(tmp, ignore_errors=True)
    settings = {
        "workers": args.workers,
        "replicas": args.replicas,
        "store": "postgresql" if args.postgres else "sqlite",
        "clients": args.clients,
        "interval_seconds": args.interval,
        "report_interval_seconds": 0.0 if args.no_fold else args.report_interval,
        "p99_target_ms": args.p99_ms,
        "kib_per_rank_target": args.kib_per_rank,
    }
    out = summary(levels=results, argv=argv, settings=settings)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("\n" + markdown(results) + "\n", flush=True)
    if args.replicas > 1 or args.postgres:
        print(fleet_markdown(results) + "\n", flush=True)
    print(
        f"highest level within the p99 target: {out['highest_within_latency_ranks']} ranks; "
        f"within every target (memory too): {out['highest_passing_ranks']}; JSON in {args.out}",
        flush=True,
    )
    return 0


def _start_servers(args: argparse.Namespace, tmp: Path, probe: Path | None, database: Database | None) -> list[Server]:
    db = database_arg(database, tmp)
    env = None
    python: tuple[str, ...] = ()
    if probe is not None:
        probe.mkdir()
        python, env = (sys.executable, "-m", "bench.load_probe"), {DIR_ENV: str(probe)}
    servers: list[Server] = []
    try:
        for _ in range(args.replicas):
            servers.append(start_server(db, args.workers, args.report_interval, python=python, env=env))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def _run(
    args: argparse.Namespace, levels: list[int], targets: Targets, servers: list[Server],
    budget: float, probe: Path | None, database: Database | None,
) -> list[Level]:  # fmt: skip
    """Every level, until one misses the target past the listed ones; the levels run."""
    pipes: list[Any] = []
    procs: list[Any] = []
    results: list[Level] = []
    failed_before = 0
    try:
        base_rss = sum(rss_bytes(proc_tree(s.proc.pid)) for s in servers)
        # Every generator stops by itself at the run's deadline, whatever becomes of this process.
        target = fleet_target([s.target for s in servers])
        pipes, procs = _start_clients(args, target, time.monotonic() + budget)
        print(
            f"server {target}, {args.replicas} replica(s) of {args.workers} worker(s) on "
            f"{'PostgreSQL' if database is not None else 'SQLite'}, base RSS {base_rss / 2**20:.0f} MiB, "
            f"{args.clients} generator process(es), {os.cpu_count()} CPUs shared by all, "
            f"a step every {args.interval:g} s per rank, "
            + ("every step reported" if args.no_fold else f"steady steps folded for up to {args.report_interval:g} s"),
            flush=True,
        )
        print_header()
        listed = len(args.ranks.split(","))
        for i, n in enumerate(levels):
            level, got, failed_before = _run_level(
                n, args, servers, pipes, base_rss=base_rss, failed_before=failed_before, targets=targets, probe=probe,
                database=database,
            )  # fmt: skip
            results.append(level)
            print_row(level)
            if level.replica_cores or level.store_rows_per_s is not None:
                print(
                    f"    replicas' cores {level.replica_cores}; store {level.store_rows_per_s} rows/s, "
                    f"{level.store_commits_per_s} commits/s, {level.store_cpu_cores} cores",
                    flush=True,
                )
            for g in got if level.errors or level.failed_streams else []:
                for e in g["error_samples"][:2]:
                    print(f"    error: {e}", flush=True)
            dead = [s for s in servers if s.proc.poll() is not None]
            if dead:
                print("a server exited:\n" + "".join(dead[0].output), flush=True)
                break
            if i + 1 >= listed and not level.latency_ok:
                if i + 1 < len(levels):
                    print(f"stopping: {n} ranks are past the service's limit on this machine", flush=True)
                break
    finally:
        _stop_clients(pipes, procs)
    return results


if __name__ == "__main__":
    sys.exit(main())
