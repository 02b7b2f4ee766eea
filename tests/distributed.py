"""Running a test's worker on several CPU ranks (gloo), each a process of its own, joined with a timeout.

A worker is a module under ``tests.workers``; it reads its settings from ``REMATD_CONFIG`` (JSON) and
writes what it measured to ``REMATD_RESULT`` (JSON), one file per rank.
"""

from __future__ import annotations

import json
import os
import re
import signal
import warnings
from pathlib import Path
from typing import Any

from bench import warm
from bench.launch import free_port

ROOT = Path(__file__).resolve().parent.parent


NATIVE_CRASHES = (-signal.SIGSEGV, -signal.SIGABRT)
"""How a rank ends when native code under it fails (a segmentation fault; glibc's abort on a corrupt heap)."""


def run_ranks(
    worker: str, tmp: Path, *, world: int, config: Any, timeout: float = 240.0, env: dict[str, str] | None = None
) -> list[Any]:
    """Run ``python -m tests.workers.<worker>`` on ``world`` ranks; each rank's result, in rank order.

    A rank that dies of a native crash (SIGSEGV, SIGABRT) fails the test only if the ranks crash again: CPU
    gloo workers under FSDP2 have died so, rarely and only on a loaded machine, of a cause not found yet (40
    runs of one such test in a loop, under glibc's heap checks, passed). The first crash is reported as a
    warning carrying the rank's log, every thread's Python stack included (faulthandler), not passed over."""
    crashed = _launch(worker, tmp, world=world, config=config, timeout=timeout, env=env, last=False)
    if crashed is not None:
        warnings.warn(f"the ranks of {worker} ran again after a native crash: {crashed}", stacklevel=2)
        _launch(worker, tmp, world=world, config=config, timeout=timeout, env=env, last=True)
    return [json.loads((tmp / f"{worker}-rank{r}.json").read_text()) for r in range(world)]


def _launch(
    worker: str, tmp: Path, *, world: int, config: Any, timeout: float, env: dict[str, str] | None, last: bool
) -> str | None:
    """One run of the ranks; None when every rank succeeded, else (unless ``last``, which raises) what crashed."""
    for r in range(world):
        (tmp / f"{worker}-rank{r}.json").unlink(missing_ok=True)  # a crashed run's results are not this one's
    port = free_port()
    procs: list[warm.Rank | warm.ColdRank] = []
    # Each rank writes to a file of its own: through pipes read one rank after another, a rank whose output
    # filled its pipe (a library's warnings every step) would block there while its peers wait for it.
    logs = [tmp / f"{worker}-rank{rank}.log" for rank in range(world)]
    for rank in range(world):
        rank_env = {
            **os.environ,
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            # A rank that dies of a signal prints every thread's Python stack first: a native crash says where.
            "PYTHONFAULTHANDLER": "1",
            "REMATD_CONFIG": json.dumps(config),
            "REMATD_RESULT": str(tmp / f"{worker}-rank{rank}.json"),
        }
        procs.append(
            warm.start(f"tests.workers.{worker}", [], env=rank_env, cwd=ROOT, stdout=logs[rank], stderr=logs[rank])
        )
    # One deadline for all ranks: a hung rank fails the test in ``timeout``.
    hung = not warm.wait_all(procs, timeout, stop_on_failure=False)
    outputs = [log.read_text(errors="replace") for log in logs]
    assert not hung, f"the ranks of {worker} did not end in {timeout:.0f} s:\n" + "\n\n".join(
        f"rank {rank}:\n{out[-2000:]}" for rank, out in enumerate(outputs)
    )
    failed = [
        (rank, p.returncode, out) for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)) if p.returncode
    ]
    # A crashed rank takes its peers down ("Connection closed/reset by peer"): show it first.
    failed.sort(key=lambda f: re.search(r"Connection (closed|reset) by peer", f[2]) is not None)
    said = "\n\n".join(f"rank {rank} exited {code}:\n{out[-4000:]}" for rank, code, out in failed[:2])
    if failed and not last and failed[0][1] in NATIVE_CRASHES:
        return said
    assert not failed, said
    return None
