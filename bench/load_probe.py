"""``rematd serve`` with its event loop watched, for ``bench.load --probe``: where a server's latency goes.

Run as ``python -m bench.load_probe serve ...`` (the arguments of ``rematd serve``). In every server process
(the workers too: they import this module as their main) it keeps:

- the event loop's lateness waking from a 10 ms sleep (the loop's own share of every ack's latency);
- each garbage collection's pause, by generation;
- while the loop is late by more than ``STALL_SECONDS``, the main thread's stack every few milliseconds:
  what held the loop (a database write, a collection, a lock), or nothing of its own (the process was
  waiting for a CPU the machine's other work held).

SIGUSR2 starts a window, SIGUSR1 ends it and writes ``probe-<pid>.json`` into ``$REMATD_PROBE_DIR``.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from types import FrameType
from typing import Any

PROBE_SECONDS = 0.01
STALL_SECONDS = 0.02
WATCH_SECONDS = 0.002
DIR_ENV = "REMATD_PROBE_DIR"


class _Probe:
    def __init__(self) -> None:
        self.lateness: list[float] = []
        self.gc: list[tuple[int, float]] = []
        self.stacks: collections.Counter[str] = collections.Counter()
        self.beat = time.monotonic()
        self._gc_started = 0.0
        self._main = threading.main_thread().ident

    def reset(self) -> None:
        self.lateness, self.gc, self.stacks = [], [], collections.Counter()

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc.append((int(info["generation"]), time.perf_counter() - self._gc_started))

    async def heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            self.beat = time.monotonic()
            await asyncio.sleep(PROBE_SECONDS)
            self.lateness.append(loop.time() - t - PROBE_SECONDS)

    def watch(self) -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            if time.monotonic() - self.beat > PROBE_SECONDS + STALL_SECONDS:
                frame = sys._current_frames().get(self._main or 0)
                if frame is not None:
                    self.stacks[_describe(frame)] += 1

    def report(self) -> dict[str, Any]:
        lat = sorted(self.lateness)
        by_gen: dict[str, dict[str, float]] = {}
        for gen, took in self.gc:
            g = by_gen.setdefault(str(gen), {"n": 0, "total_ms": 0.0, "max_ms": 0.0})
            g["n"] += 1
            g["total_ms"] = round(g["total_ms"] + took * 1000, 1)
            g["max_ms"] = round(max(g["max_ms"], took * 1000), 1)
        return {
            "pid": os.getpid(),
            "wakeups": len(lat),
            "loop_p50_ms": round(lat[len(lat) // 2] * 1000, 2) if lat else None,
            "loop_p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000, 2) if lat else None,
            "loop_max_ms": round(lat[-1] * 1000, 2) if lat else None,
            "gc": by_gen,
            "stall_samples": sum(self.stacks.values()),
            "stall_stacks": self.stacks.most_common(8),
        }


def _describe(frame: FrameType | None, depth: int = 8) -> str:
    """The innermost frames, innermost first: file:line function."""
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(out)


_probe = _Probe()


def _install() -> None:
    gc.callbacks.append(_probe.on_gc)
    run = asyncio.run

    def watched_run(main: Coroutine[Any, Any, Any], **kwargs: Any) -> Any:
        async def with_heartbeat() -> Any:
            beat = asyncio.ensure_future(_probe.heartbeat())
            try:
                return await main
            finally:
                beat.cancel()

        threading.Thread(target=_probe.watch, name="load-probe", daemon=True).start()
        return run(with_heartbeat(), **kwargs)

    asyncio.run = watched_run  # type: ignore[assignment]

    def end_window(_sig: int, _frame: Any) -> None:
        out = Path(os.environ.get(DIR_ENV, "."))
        (out / f"probe-{os.getpid()}.json").write_text(json.dumps(_probe.report()))

    signal.signal(signal.SIGUSR2, lambda _s, _f: _probe.reset())
    signal.signal(signal.SIGUSR1, end_window)


def read_windows(folder: Path) -> list[dict[str, Any]]:
    """What each probed process wrote at the end of the window (the busiest loop first)."""
    got = []
    for f in folder.glob("probe-*.json"):
        report = json.loads(f.read_text())
        if report["wakeups"]:
            got.append(report)
        f.unlink()
    return sorted(got, key=lambda r: -(r["loop_p99_ms"] or 0))


# Spawned workers import this module as their main, so the probe is installed in each of them.
if os.environ.get(DIR_ENV):
    _install()

if __name__ == "__main__":
    from rematd.server.cli import main

    sys.exit(main(sys.argv[1:]))
