"""Which process holds each connected rank: ranks a killed process held (ghosts) read as lost, not connected.

A rank's row says ``connected`` from its hello until its stream's end is written. A process that is killed
(SIGKILL, the OOM killer, a lost machine) writes no end: its ranks read as connected for ever, and retention,
which keeps every job with a connected rank, kept their jobs for ever. So each process (each worker, each
replica) names itself on the rows of the ranks it opens and says it is alive in ``holders`` every
``HEARTBEAT_SECONDS``. A connected rank reads as ``disconnected`` once its holder has not been seen for
``HOLDER_TIMEOUT_SECONDS``, or at once when its holder ran on this host and is no running process any more
(a restart on the same machine, a worker its parent restarted): then it is retained as any lost rank's job.
Read, not rewritten: a process that stalled past the timeout reads as connected again at its next heartbeat.
"""

from __future__ import annotations

import os
import secrets
import socket

HEARTBEAT_SECONDS = 5.0
"""How often a process says it is alive."""
HOLDER_TIMEOUT_SECONDS = 30.0
"""A process not seen this long holds no rank any more (six heartbeats missed)."""

RANK_STATE = """CASE WHEN ranks.state <> 'connected' THEN ranks.state
    WHEN ranks.holder = :holder OR EXISTS (SELECT 1 FROM holders h WHERE h.holder = ranks.holder
        AND h.seen_at >= :alive) THEN 'connected'
    ELSE 'disconnected' END"""
"""A rank's state as read: ``connected`` only while the process that holds it is alive (parameters
``holder``, this process, and ``alive``, the oldest heartbeat of a live process)."""


def new_holder() -> str:
    """This process's name on the ranks it opens: its host, its process id, and a part of its own (a process
    id comes back after a restart)."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{secrets.token_hex(4)}"


def gone_here(holder: str) -> bool:
    """Whether ``holder`` ran on this host and its process is no longer running (a process id taken over by
    another process since reads as running: the timeout still tells)."""
    host, _, rest = holder.partition(":")
    pid, _, _ = rest.partition(":")
    if host != socket.gethostname()[:64] or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: running
        return False
    return False
