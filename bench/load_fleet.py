"""The load bench against a fleet: ``--replicas`` services on one local PostgreSQL (``--postgres``), the
generators' channels spreading their ranks over them as the rematd client does (round_robin over the
addresses). What it adds to each level: each replica's CPU, and the database's write rate (rows and
commits a second, from ``pg_stat_database``) and CPU."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bench.load_server import Usage, UsageWindow, cpu_seconds, proc_tree
from bench.postgres import Cluster, pg_bin

MAX_CONNECTIONS = 400
"""The cluster's connection limit: each replica's pool and writer hold a few."""


@dataclass(frozen=True, slots=True)
class StoreUse:
    rows_per_s: float
    """Rows inserted or updated a second (step reports, ranks' last steps, plans)."""
    commits_per_s: float
    cores: float
    """The database's processes' CPU."""


class Database:
    """A throw-away PostgreSQL cluster for the bench, and what it did over a window."""

    def __init__(self) -> None:
        bindir = pg_bin()
        if bindir is None:
            raise SystemExit("--postgres needs PostgreSQL's binaries (Debian package 'postgresql')")
        self.cluster = Cluster(bindir, f"max_connections={MAX_CONNECTIONS}")
        self.cluster.start()
        self.url = self.cluster.create()

    def _counts(self) -> tuple[int, int]:
        import psycopg

        with psycopg.connect(self.url) as conn:
            row = conn.execute(
                "SELECT tup_inserted + tup_updated, xact_commit FROM pg_stat_database WHERE datname = 'rematd'"
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def _pids(self) -> list[int]:
        postmaster = int((self.cluster.data / "postmaster.pid").read_text().split()[0])
        return proc_tree(postmaster)

    def open(self) -> tuple[float, tuple[int, int], float]:
        return time.monotonic(), self._counts(), cpu_seconds(self._pids())

    def close(self, opened: tuple[float, tuple[int, int], float]) -> StoreUse:
        t0, (rows0, commits0), cpu0 = opened
        took = max(1e-9, time.monotonic() - t0)
        rows, commits = self._counts()
        return StoreUse(
            rows_per_s=round((rows - rows0) / took, 1),
            commits_per_s=round((commits - commits0) / took, 1),
            cores=round((cpu_seconds(self._pids()) - cpu0) / took, 2),
        )

    def remove(self) -> None:
        self.cluster.remove()


class FleetWindow:
    """A measurement over every replica (and the database): the fleet's usage, each replica's CPU."""

    def __init__(self, pids: list[int], database: Database | None, *, signal_processes: bool = False) -> None:
        self.windows = [UsageWindow(pid, signal_processes=signal_processes) for pid in pids]
        self.database = database
        self._db = database.open() if database is not None else None

    def close(self) -> tuple[Usage, list[float], StoreUse | None]:
        usages = [w.close() for w in self.windows]
        by_process = tuple(sorted((c for u in usages for c in u.cores_by_process), reverse=True))
        total = Usage(
            cores=sum(u.cores for u in usages), rss_bytes=sum(u.rss_bytes for u in usages), cores_by_process=by_process
        )
        store = self.database.close(self._db) if self.database is not None and self._db is not None else None
        return total, [round(u.cores, 2) for u in usages], store


def fleet_target(targets: list[str]) -> str:
    """One gRPC target for every replica: ``ipv4:`` and their addresses (round_robin spreads over them)."""
    return targets[0] if len(targets) == 1 else "ipv4:" + ",".join(targets)


def database_arg(database: Database | None, tmp: Path) -> Path | str:
    """What each replica gets as ``--db``: the cluster's URL, or a SQLite file of the run's own."""
    return database.url if database is not None else tmp / "load.db"
