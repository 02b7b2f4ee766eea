"""What the load bench reports: one ``Level`` per number of ranks, as a live table, a Markdown table, JSON."""

from __future__ import annotations

import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.load_server import Usage


@dataclass
class Level:
    ranks: int
    seconds: float
    sent: int
    acked: int
    errors: int
    """Streams that failed while measuring."""
    live: int
    """Ranks with an open stream at the end of the measurement."""
    failed_streams: int
    """Streams that failed at this level, its ramp included (each rank opens another after a backoff)."""
    ramp_s: float
    """Seconds this level's new ranks took to connect (hellos answered)."""
    gave_up: int
    """Ranks that stopped after ``MAX_STREAMS`` failed streams, since the start."""
    rate_per_s: float
    steps_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    stale_s: float
    server_cpu_cores: float
    server_cores_by_process: list[float]
    """The server's processes' shares of ``server_cpu_cores``, busiest first (the supervisor among them)."""
    server_rss_mib: float
    server_kib_per_rank: float
    gen_cpu_cores: float
    gen_lag_p50_ms: float
    gen_lag_p99_ms: float
    gen_lag_max_ms: float
    gen_loop_p99_ms: float
    load_1m: float
    """The machine's load average at the end of the measurement: other work competes for the same cores."""
    latency_ok: bool
    """Every rank live and heard from in time, no stream failed while measuring, p99 under the target."""
    ok: bool
    """``latency_ok`` and the server's memory per rank under its target."""
    server_loop_p99_ms: float | None = None
    """With ``--probe``: the busiest server process's event loop, late waking from a 10 ms sleep, p99."""
    server_loop_max_ms: float | None = None
    server_gc_max_ms: float | None = None
    """With ``--probe``: the longest garbage collection in any server process."""
    server_stalls: list[str] | None = None
    """With ``--probe``: what the busiest loop was doing while late by more than 20 ms (samples, stack)."""
    replica_cores: list[float] | None = None
    """With ``--replicas``: each replica's CPU (its whole process tree), in the order they were started."""
    store_rows_per_s: float | None = None
    """With ``--postgres``: rows the database inserted or updated a second."""
    store_commits_per_s: float | None = None
    store_cpu_cores: float | None = None
    """With ``--postgres``: the database's own CPU."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Targets:
    p99_ms: float
    kib_per_rank: float
    longest_quiet_s: float
    """The longest a rank may go unheard: its report interval and a step."""


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of seconds ``xs``, in milliseconds (NaN for none)."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def level_of(
    *, ranks: int, seconds: float, ramp: float, got: list[dict[str, Any]], failed_streams: int, base_rss: int,
    usage: Usage, targets: Targets, probed: list[dict[str, Any]] | None = None,
) -> Level:  # fmt: skip
    """One level from what each generator process measured (``got``) and what the server used meanwhile."""
    lat = [x for g in got for x in g["lat"]]
    lag = [x for g in got for x in g["lag"]]
    loop = [x for g in got for x in g["loop"]]
    errors = sum(g["errors"] for g in got)
    live = sum(g["live"] for g in got)
    acked = sum(g["acked"] for g in got)
    stale = max(g["stale"] for g in got)
    p99 = pct(lat, 0.99)
    kib = (usage.rss_bytes - base_rss) / 1024 / ranks
    latency_ok = (
        errors == 0 and live == ranks and acked > 0 and p99 < targets.p99_ms and stale <= targets.longest_quiet_s + 1.0
    )
    probe: dict[str, Any] = {}
    if probed:
        busiest = probed[0]
        gcs = [g["max_ms"] for p in probed for g in p["gc"].values()]
        probe = dict(
            server_loop_p99_ms=busiest["loop_p99_ms"], server_loop_max_ms=max(p["loop_max_ms"] for p in probed),
            server_gc_max_ms=max(gcs, default=0.0),
            server_stalls=[f"{n} x {stack}" for stack, n in busiest["stall_stacks"][:5]],
        )  # fmt: skip
    return Level(
        **probe,
        ranks=ranks, seconds=seconds, sent=sum(g["sent"] for g in got), acked=acked, errors=errors, live=live,
        failed_streams=failed_streams, ramp_s=round(ramp, 1), gave_up=sum(g["gave_up"] for g in got),
        rate_per_s=round(acked / seconds, 1), steps_per_s=round(sum(g["steps"] for g in got) / seconds, 1),
        p50_ms=round(pct(lat, 0.5), 2), p99_ms=round(p99, 2), max_ms=round(max(lat) * 1000 if lat else 0, 1),
        stale_s=round(stale, 2), server_cpu_cores=round(usage.cores, 2),
        server_cores_by_process=list(usage.cores_by_process),
        server_rss_mib=round(usage.rss_bytes / 2**20, 1), server_kib_per_rank=round(kib, 1),
        gen_cpu_cores=round(sum(g["cpu"] for g in got), 2), gen_lag_p50_ms=round(pct(lag, 0.5), 2),
        gen_lag_p99_ms=round(pct(lag, 0.99), 2), gen_lag_max_ms=round(max(lag) * 1000 if lag else 0, 1),
        gen_loop_p99_ms=round(pct(loop, 0.99), 2), load_1m=round(os.getloadavg()[0], 2), latency_ok=latency_ok,
        ok=latency_ok and kib < targets.kib_per_rank,
    )  # fmt: skip


def print_header() -> None:
    print(
        f"{'':>7} {'':>6} {'':>6} {'stream':>6} {'':>6} {'':>7} {'service latency, ms':>26} {'':>7} {'':>5}  "
        f"{'server':^19}   {'generator':^39}",
        flush=True,
    )
    print(
        f"{'ranks':>7} {'live':>6} {'ramp s':>6} {'fails':>6} {'msg/s':>6} {'steps/s':>7} "
        f"{'p50':>8} {'p99':>8} {'max':>8} "
        f"{'stale s':>7} {'errs':>5}  {'cores':>5} {'MiB':>6} {'KiB/rk':>6}   {'cores':>5} {'lag p50':>7} "
        f"{'p99':>6} {'max':>6} {'loop p99':>8} {'load':>6}  ok",
        flush=True,
    )


def print_row(r: Level) -> None:
    print(
        f"{r.ranks:>7} {r.live:>6} {r.ramp_s:>6.1f} {r.failed_streams:>6} {r.rate_per_s:>6.0f} {r.steps_per_s:>7.0f} "
        f"{r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.max_ms:>8.1f} {r.stale_s:>7.1f} {r.errors:>5}  "
        f"{r.server_cpu_cores:>5.2f} {r.server_rss_mib:>6.0f} {r.server_kib_per_rank:>6.1f}   "
        f"{r.gen_cpu_cores:>5.2f} {r.gen_lag_p50_ms:>7.2f} {r.gen_lag_p99_ms:>6.1f} {r.gen_lag_max_ms:>6.1f} "
        f"{r.gen_loop_p99_ms:>8.2f} {r.load_1m:>6.2f}  "
        f"{'yes' if r.ok else ('latency' if r.latency_ok else 'NO')}"
        f"  (server cores by process {'/'.join(f'{c:.2f}' for c in r.server_cores_by_process)})",
        flush=True,
    )
    if r.server_loop_p99_ms is not None:
        print(
            f"    server loop late p99 {r.server_loop_p99_ms} ms, max {r.server_loop_max_ms} ms; "
            f"longest collection {r.server_gc_max_ms} ms; while late it was in:",
            flush=True,
        )
        for stall in r.server_stalls or ["(nothing sampled)"]:
            print(f"      {stall[:220]}", flush=True)


def markdown(levels: list[Level]) -> str:
    """The curve as a Markdown table, the one docs/benchmarks.md shows."""
    head = (
        "| ranks | live | ramp s | failed streams | reports/s | steps/s | p50 ms | p99 ms | max ms | stalest view s "
        "| errors | server cores | server RSS MiB | KiB/rank | generator cores | generator lag p50 / p99 / max ms "
        "| generator loop p99 ms | server loop p99 / max ms | load average | within p99 target |"
    )
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in levels:
        server_loop = "-" if r.server_loop_p99_ms is None else f"{r.server_loop_p99_ms:g} / {r.server_loop_max_ms:g}"
        rows.append(
            f"| {r.ranks:,} | {r.live:,} | {r.ramp_s:g} | {r.failed_streams} | {r.rate_per_s:,.0f} "
            f"| {r.steps_per_s:,.0f} | {r.p50_ms:g} | {r.p99_ms:g} | {r.max_ms:g} | {r.stale_s:.0f} | {r.errors} "
            f"| {r.server_cpu_cores:g} | {r.server_rss_mib:.0f} | {r.server_kib_per_rank:g} | {r.gen_cpu_cores:g} "
            f"| {r.gen_lag_p50_ms:g} / {r.gen_lag_p99_ms:g} / {r.gen_lag_max_ms:g} | {r.gen_loop_p99_ms:g} "
            f"| {server_loop} | {r.load_1m:g} | {'yes' if r.latency_ok else 'no'} |"
        )
    return "\n".join(rows)


def fleet_markdown(levels: list[Level]) -> str:
    """What a fleet run adds: per replica CPU, CPU per 1,000 ranks, and the database's write rate."""
    head = (
        "| ranks | replicas | p99 ms | steps/s | reports/s | server cores by replica | server cores per 1,000 ranks "
        "| store rows/s | store commits/s | database cores | load average | within p99 target |"
    )
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in levels:
        replicas = r.replica_cores or [r.server_cpu_cores]
        rows.append(
            f"| {r.ranks:,} | {len(replicas)} | {r.p99_ms:g} | {r.steps_per_s:,.0f} | {r.rate_per_s:,.0f} "
            f"| {' / '.join(f'{c:g}' for c in replicas)} | {r.server_cpu_cores / r.ranks * 1000:.3f} "
            f"| {r.store_rows_per_s if r.store_rows_per_s is not None else '-'} "
            f"| {r.store_commits_per_s if r.store_commits_per_s is not None else '-'} "
            f"| {r.store_cpu_cores if r.store_cpu_cores is not None else '-'} | {r.load_1m:g} "
            f"| {'yes' if r.latency_ok else 'no'} |"
        )
    return "\n".join(rows)


def summary(*, levels: list[Level], argv: list[str] | None, settings: dict[str, Any]) -> dict[str, Any]:
    """The run as JSON: its settings, every level, and the highest level within the targets."""
    passing = [r.ranks for r in levels if r.ok]
    failing = [r.ranks for r in levels if not r.ok]
    within = [r.ranks for r in levels if r.latency_ok]
    return {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        **settings,
        "levels": [asdict(r) for r in levels],
        "highest_passing_ranks": max(passing) if passing else 0,
        "first_failing_ranks": min(failing) if failing else None,
        "highest_within_latency_ranks": max(within) if within else 0,
        "p50_ms_median_over_levels": statistics.median([r.p50_ms for r in levels]) if levels else None,
    }
