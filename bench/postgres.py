"""A throw-away PostgreSQL cluster in a temp dir, on a unix socket only (no TCP port at all), for the fleet
benchmark and the tests that need a real database. Needs the server's binaries (Debian package ``postgresql``)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path


def pg_bin() -> str | None:
    """The folder of ``initdb`` and ``pg_ctl``, or None where PostgreSQL is not installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


class Cluster:
    """``initdb``, then :meth:`start` and :meth:`stop` as often as wanted; :meth:`remove` at the end."""

    def __init__(self, bindir: str, *settings: str) -> None:
        """``settings``: more ``-c name=value`` server options (``fsync=off`` always: nothing here outlives it)."""
        self.bindir = bindir
        self.base = Path(tempfile.mkdtemp(prefix="rematd-pg-"))
        self.data, self.sock = self.base / "data", self.base / "sock"
        self.sock.mkdir()
        self.settings = ("fsync=off", *settings)
        self._prefix: list[str] = []
        if os.geteuid() == 0:
            # PostgreSQL refuses to run as root: run it as the package's own user.
            shutil.chown(self.base, "postgres")
            shutil.chown(self.sock, "postgres")
            self._prefix = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self._prefix, f"{self.bindir}/{tool}", *args], check=True, capture_output=True, text=True, timeout=120
        )

    def url(self, db: str = "rematd") -> str:
        return f"postgresql://postgres@/{db}?host={self.sock}"

    def start(self) -> None:
        options = f"-c listen_addresses='' -k {self.sock} " + " ".join(f"-c {s}" for s in self.settings)
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.base / "log"), "-w", "-t", "60", "-o", options, "start"
        )

    def create(self, db: str = "rematd") -> str:
        """A new database; its URL."""
        self._run("createdb", "-h", str(self.sock), "-U", "postgres", db)
        return self.url(db)

    def stop(self) -> None:
        subprocess.run(
            [*self._prefix, f"{self.bindir}/pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop"],
            capture_output=True,
            timeout=120,
        )

    def processes(self) -> list[int]:
        """The running server's processes: the postmaster and its children (backends, writers)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    # The field after the command (in parentheses, which may hold spaces) and the state.
                    ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == postmaster:
                    children.append(int(proc.name))
        return [postmaster, *children]

    def freeze(self) -> None:
        """Stop every process of the server (SIGSTOP): connections stay open and nothing answers."""
        for pid in self.processes():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Let a frozen server go on (SIGCONT)."""
        for pid in self.processes():
            os.kill(pid, signal.SIGCONT)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)
