"""Ranks forked from a process that has already imported torch: each rank skips the seconds a fresh interpreter
spends importing it (about 4 s of CPU on the development VM, paid by every rank of every launch).

One fork server per process that launches ranks (Python's ``forkserver`` start method), started at the first
launch: it imports :data:`PRELOAD` once, and each rank is a fork of it that takes its environment, its working
directory, its standard output and error and its command line (``python -m MODULE ARGS``) as a fresh process
would. Nothing else is imported before the fork: rematd, the benchmarks and the tests read their settings from
the environment as they are imported, in the rank.

A rank is a :class:`Rank`, with ``poll``, ``kill`` and ``returncode`` as a ``subprocess.Popen`` has them;
:func:`wait_all` waits for several with a timeout. A native crash ends a rank with the signal's negative
number, as it would a fresh process. ``REMATD_WARM_RANKS=0`` starts every rank as a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import types
from multiprocessing.context import ForkServerContext
from pathlib import Path

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
)
"""What the fork server imports before forking: torch, and its packages that ranks of FSDP2, tensor parallel and
pipeline schedules import (DTensor's SymPy, the pipelines' Dynamo: 2.5 s more). What these read from the
environment as they are imported (``TORCH_LOGS``, say) the ranks take from the launching process, whatever
environment they are given."""

LIBRARIES = (
    "torch._inductor.compile_fx",
    "datasets",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
)
"""What a process that starts many ranks of many kinds preloads as well (:func:`also_preload`; the tests do):
Inductor and Hugging Face's ``datasets`` (torchtitan's ranks import both) and ``transformers`` (the stock
models'), 4.3 s more for the server, as much less for each rank that imports them; and the GPT-2 and Llama
modules of ``transformers``, which its top level imports only when a model is built (1.7 s a rank that builds
one). As :data:`PRELOAD`, they read ``TORCHINDUCTOR_*`` and ``HF_*`` from the launching process's environment."""

_lock = threading.Lock()
_context: ForkServerContext | None = None
_extra: list[str] = []


def also_preload(*modules: str) -> None:
    """Have the fork server import ``modules`` beside :data:`PRELOAD`: where called before the first rank starts
    (the server starts with it, once a process); one that is not installed is left out."""
    with _lock:
        _extra.extend(m for m in modules if m not in _extra)


def enabled() -> bool:
    """Whether ranks are forked warm: on Linux (the fork server), unless ``REMATD_WARM_RANKS=0``."""
    return sys.platform == "linux" and os.environ.get("REMATD_WARM_RANKS", "1") != "0"


def _forkserver() -> ForkServerContext:
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([*PRELOAD, *_extra])
            _context = ctx
        return _context


class Rank:
    """One forked rank, handled as a ``subprocess.Popen``."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the rank and what it started (it leads a session of its own)."""
        if self._process.exitcode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet a session leader: the rank alone
                self._process.kill()
            self._process.join()


class ColdRank:
    """A rank started as a fresh interpreter (``REMATD_WARM_RANKS=0``, or off Linux), handled as a :class:`Rank`."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    def poll(self) -> int | None:
        return self._process.poll()

    def kill(self) -> None:
        if self._process.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self._process.wait()


def start(
    module: str, args: list[str], *, env: dict[str, str], cwd: Path, stdout: Path, stderr: Path
) -> Rank | ColdRank:
    """Start ``python -m module args`` with ``env`` (the whole environment) in ``cwd``, in a session of its own,
    its output written afresh to the files (one file for both where they are the same): forked warm where
    :func:`enabled`, else a fresh interpreter."""
    if not enabled():
        with stdout.open("w") as out, stderr.open("w") as err:
            return ColdRank(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    cwd=cwd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT if stderr == stdout else err,
                    start_new_session=True,
                )
            )
    process = _forkserver().Process(
        target=_run, args=(module, list(args), dict(env), str(cwd), str(stdout), str(stderr)), name=module
    )
    # multiprocessing has each child import the launching process's main module first (a benchmark's, a
    # script's), before the rank's environment is set: whatever it imports would keep the launcher's settings,
    # and a script without a main guard would launch again. The rank runs only its own module.
    with _lock:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            process.start()
        finally:
            sys.modules["__main__"] = main
    return Rank(process)


def _run(module: str, args: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """In the fork: become the process ``python -m module args`` would have started."""
    os.setsid()  # a session of its own, as the launchers give their ranks: killed with what it started
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out = os.open(stdout, flags, 0o644)
    err = out if stderr == stdout else os.open(stderr, flags, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - fds 1 and 2 outlive the rank's code
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [module, *args]
    sys.path[0] = cwd
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, int) and done.code is not None:
            print(done.code, file=sys.stderr)
    finally:
        # A fresh interpreter runs its exit functions and flushes; a fork's exit does neither.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def wait_all(ranks: list[Rank | ColdRank], timeout: float, *, stop_on_failure: bool) -> bool:
    """Wait up to ``timeout`` seconds for every rank, then kill those still running; False when the time ran
    out first. With ``stop_on_failure`` (as torchrun does) a rank that fails ends the wait at once."""
    deadline = time.monotonic() + timeout
    in_time = True
    try:
        while any(r.poll() is None for r in ranks):
            if stop_on_failure and any(r.returncode not in (None, 0) for r in ranks):
                break
            if time.monotonic() > deadline:
                in_time = False
                break
            time.sleep(0.05)
    finally:
        for r in ranks:
            r.kill()
    return in_time
