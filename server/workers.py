"""Several service processes on one gRPC port (SO_REUSEPORT), supervised by the process that started them.

The kernel spreads new connections over the processes; a rank's stream stays
on the process that accepted it, so its in-memory session state is per
process. Worker 0 also serves HTTP; the others serve gRPC only. All share the
store, and operator controls written through worker 0 reach the others by
polling it. Counters and latency histograms are prometheus_client's
multiprocess files in the run's own folder (a dead worker's counts stay
counted); the workers publish their live ranks for worker 0's per-job gauges
(``rematd.server.metrics.peers``).

A worker that dies (killed, crashed) is started again in its place, the others
untouched: their streams go on, and the dead worker's ranks reconnect (their
clients back off and retry) to whichever worker the kernel gives them. The
ranks it held are marked disconnected in the store at once, as its last
publication lists them, so that they do not read as connected forever. A
worker that keeps dying (``MAX_RESTARTS`` within ``RESTART_WINDOW_SECONDS``),
or one that exits because its settings or store are wrong (status 2), stops
the service, with a line saying which and why, and a non-zero exit status.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from rematd.server.app import store_config
from rematd.server.config import ServeConfig
from rematd.server.metrics import peers
from rematd.server.run import run_one
from rematd.server.store.store import Store

log = logging.getLogger("rematd.server")

MAX_RESTARTS = 5
"""Restarts of one worker within ``RESTART_WINDOW_SECONDS`` after which the service stops instead."""
RESTART_WINDOW_SECONDS = 60.0
BAD_SETTINGS = 2
"""A worker's exit status for a store or settings it cannot use: starting it again would fail the same way."""
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to stop this worker when the supervisor dies (SIGKILLed, it cannot stop them itself)."""
    # Not Linux: the workers outlive a killed supervisor.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _worker(config: ServeConfig, index: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    # Worker 0 serves HTTP and says where; the others only serve gRPC.
    sys.exit(run_one(config, announce=index == 0))


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _fixed_ports(config: ServeConfig) -> ServeConfig:
    """Port 0 picked once, here: every worker binds the same gRPC port, and a restarted worker 0 the same HTTP one."""
    if config.grpc_port == 0:
        config = dataclasses.replace(config, grpc_port=_free_port(config.grpc_host))
    if config.http and config.http_port == 0:
        config = dataclasses.replace(config, http_port=_free_port(config.http_host))
    return dataclasses.replace(config, grpc=dataclasses.replace(config.grpc, reuse_port=True))


class Supervisor:
    """The worker processes of one service: started, watched, started again when one dies."""

    def __init__(
        self,
        config: ServeConfig,
        workers: int,
        shared: Path,
        *,
        target: Callable[..., None] = _worker,
        args: tuple[object, ...] | None = None,
    ) -> None:
        """``target`` runs a worker, given ``args`` (by default its settings and index)."""
        self.config = config
        self.target = target
        self.args = args
        self.shared = shared
        self.procs: list[BaseProcess | None] = [None] * workers
        """Each worker's process, by index (None before it is started)."""
        self.restarts: list[collections.deque[float]] = [collections.deque() for _ in range(workers)]
        self.stopping = False
        self.failure: tuple[str, int] | None = None
        """Why the service stops of itself (a line for the log) and its exit status."""
        self._ctx = mp.get_context("spawn")

    def start(self, index: int) -> None:
        cfg = dataclasses.replace(
            self.config, worker_index=index, shared_dir=str(self.shared), http=self.config.http and index == 0
        )
        args = self.args if self.args is not None else (cfg, index)
        p = self._ctx.Process(target=self.target, args=args, name=f"rematd-worker-{index}", daemon=False)
        p.start()
        self.procs[index] = p

    def stop(self, _sig: int = 0, _frame: FrameType | None = None) -> None:
        self.stopping = True
        for p in self.procs:
            if p is not None and p.pid is not None and p.is_alive():
                p.terminate()

    def watch(self) -> None:
        """Until every worker has stopped: restart those that die while the service runs."""
        while True:
            if not self.stopping:
                for index, p in enumerate(self.procs):
                    if p is not None and p.exitcode is not None and not self.stopping:
                        self._died(index, p)
            alive = [p for p in self.procs if p is not None and p.is_alive()]
            if alive:
                multiprocessing.connection.wait([p.sentinel for p in alive], timeout=1.0)
            elif self.stopping:
                return
            # else: one died since the check above (a restart that failed at once): the next pass sees it

    def _died(self, index: int, p: BaseProcess) -> None:
        code, pid = p.exitcode or 0, p.pid or 0
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        self._forget(pid, index)
        now = time.monotonic()
        recent = self.restarts[index]
        while recent and now - recent[0] > RESTART_WINDOW_SECONDS:
            recent.popleft()
        if code == BAD_SETTINGS:
            self._give_up(f"worker {index} (pid {pid}) {how}: its store or settings are unusable", BAD_SETTINGS)
        elif len(recent) >= MAX_RESTARTS:
            self._give_up(
                f"worker {index} (pid {pid}) {how}, its {len(recent) + 1}th exit within {RESTART_WINDOW_SECONDS:.0f} s",
                1,
            )
        else:
            recent.append(now)
            log.error("worker %d (pid %d) %s; starting it again, the other workers go on", index, pid, how)
            self.start(index)

    def _give_up(self, why: str, status: int) -> None:
        log.error("%s; stopping the service", why)
        self.failure = (why, status)
        self.stop()

    def _forget(self, pid: int, index: int) -> None:
        """What a dead worker leaves: its live gauges' files, and its ranks still marked connected in the store."""
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(peers.metrics_dir(self.shared)))  # type: ignore[no-untyped-call]
        held = peers.held_ranks(self.shared, index)
        if not held:
            return
        try:
            store = Store(store_config(self.config))
            try:
                store.disconnect_ranks(held)
            finally:
                store.close()
        except Exception as err:  # the restart matters more: the ranks' next hello sets them right
            log.warning("could not mark the %d rank(s) of worker %d disconnected: %s", len(held), index, err)
            return
        log.info("worker %d's %d rank(s) marked disconnected until they reconnect", index, len(held))

    def status(self) -> int:
        if self.failure is not None:
            return self.failure[1]
        # A worker stopped by the supervisor's SIGTERM exits 0 once it has drained (or dies of it, still starting);
        # any other end is a failure.
        codes = [
            0 if self.stopping and p.exitcode == -signal.SIGTERM else abs(p.exitcode or 0)
            for p in self.procs
            if p is not None
        ]
        return max(codes, default=0)


def serve_workers(config: ServeConfig, workers: int) -> int:
    """Run ``workers`` processes until SIGTERM or SIGINT; the exit status (non-zero when a worker failed
    for good, with a line in the log saying which and why)."""
    config = _fixed_ports(config)
    # Migrate once, here, before the workers open the store.
    Store(store_config(config)).close()
    shared = Path(tempfile.mkdtemp(prefix="rematd-workers-"))
    # Set before the workers start (and import prometheus_client): their counters and histograms go to files.
    peers.metrics_dir(shared).mkdir()
    os.environ[peers.MULTIPROC_ENV] = str(peers.metrics_dir(shared))
    supervisor = Supervisor(config, workers, shared)
    for i in range(workers):
        supervisor.start(i)
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    print(f"rematd: {workers} worker processes share gRPC port {config.grpc_port}", flush=True)
    try:
        supervisor.watch()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    if supervisor.failure is not None:
        print(f"rematd serve: {supervisor.failure[0]}; stopped", file=sys.stderr, flush=True)
    return supervisor.status()
