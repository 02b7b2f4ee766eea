"""The write-behind buffer of step statistics: appended from the event loop, written in batches.

One row per rank per step is most of the store's write load, so rows wait here
(at most ``flush_seconds``) and go to the database in one transaction. A batch
the database refuses for a reason of the database (locked, unreachable) is kept
for the next round; a batch refused because of a row in it is written again a
row at a time, and each row the database still refuses is set aside (logged,
counted), so one bad row never holds up the others, nor itself forever.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy import exc as sa_exc

from rematd.server.store.columns import dumps
from rematd.server.store.rows import OPTIONAL_STEP_COLUMNS, STEP_COLUMNS, LastStepRow

log = logging.getLogger("rematd.server")

_INSERT = text(f"INSERT INTO stats ({', '.join(STEP_COLUMNS)}) VALUES ({', '.join(':' + c for c in STEP_COLUMNS)})")
# Errors of the database itself, not of what was written: worth another try, the rows are kept.
_TRANSIENT = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError)


class WriteBehind:
    """Buffered statistics rows and the latest row per rank, flushed together."""

    def __init__(self, engine: Engine, write_lock: threading.RLock, max_buffered: int) -> None:
        self.engine = engine
        self.max_buffered = max_buffered
        self._write_lock = write_lock
        self._pending: list[dict[str, Any]] = []
        self._pending_last: dict[tuple[str, int], LastStepRow] = {}
        self._flush_lock = threading.Lock()
        # The buffer has its own lock: the event loop appends to it and must never wait on a database write.
        self._buf_lock = threading.Lock()
        self._in_flight = False
        """Rows taken out of the buffer are being written (under ``_flush_lock``): the buffer is not idle."""
        self.rejected = 0
        """Rows the database refused, set aside."""
        self.set_aside: collections.deque[tuple[str, dict[str, Any]]] = collections.deque(maxlen=100)
        """The latest rows set aside, for a look in a debugger or a test."""
        self.on_rejected: Callable[[], None] | None = None

    def pending(self) -> int:
        return len(self._pending)

    def idle(self) -> bool:
        """Nothing to write: no rows, no rank's last statistics (kept alone after a failure to write them), and
        none being written by another thread (which keeps them again if its write fails)."""
        with self._buf_lock:
            return not self._pending and not self._pending_last and not self._in_flight

    def last(self, job: str, rank: int) -> LastStepRow | None:
        """The rank's newest buffered row, if the buffer holds one."""
        with self._buf_lock:
            return self._pending_last.get((job, rank))

    def add(self, *, job: str, rank: int, row: LastStepRow) -> bool:
        """Buffer one step's row; True when the buffer is full enough to flush now."""
        full = {**row, "job": job, "rank": rank}
        with self._buf_lock:
            self._pending.append({c: full.get(c) if c in OPTIONAL_STEP_COLUMNS else full[c] for c in STEP_COLUMNS})
            self._pending_last[(job, rank)] = row
            return len(self._pending) >= self.max_buffered

    def flush(self) -> None:
        """Write what is buffered; raises (keeping the rows) only when the database itself fails."""
        with self._flush_lock:
            with self._buf_lock:
                rows, self._pending = self._pending, []
                last, self._pending_last = self._pending_last, {}
                self._in_flight = bool(rows or last)
            if not self._in_flight:
                return
            try:
                with self._write_lock, self.engine.begin() as conn:
                    self._write(conn, rows, last)
            except _TRANSIENT:
                self._keep(rows, last)
                raise
            except Exception:
                self._write_each(rows, last)
            finally:
                with self._buf_lock:
                    self._in_flight = False

    def _write(self, conn: Connection, rows: list[dict[str, Any]], last: dict[tuple[str, int], LastStepRow]) -> None:
        if rows:
            conn.execute(_INSERT, rows)
        if not last:
            return
        conn.execute(
            text("UPDATE ranks SET last_stats=:s WHERE job=:job AND rank=:rank"),
            [{"s": dumps(r), "job": j, "rank": k} for (j, k), r in last.items()],
        )
        jobs: dict[str, dict[str, Any]] = {}
        for (j, _k), r in last.items():
            if j not in jobs or r["time"] > jobs[j]["t"]:
                jobs[j] = {"job": j, "t": r["time"], "b": r["budget_bytes"]}
        conn.execute(text("UPDATE jobs SET updated_at=:t, budget_bytes=:b WHERE job=:job"), list(jobs.values()))

    def _write_each(self, rows: list[dict[str, Any]], last: dict[tuple[str, int], LastStepRow]) -> None:
        items: list[tuple[str, Any]] = [("stats", r) for r in rows]
        # Oldest first, so a job's updated_at only moves forward.
        items += [("last", kv) for kv in sorted(last.items(), key=lambda kv: kv[1]["time"])]
        for i, (kind, item) in enumerate(items):
            try:
                with self._write_lock, self.engine.begin() as conn:
                    if kind == "stats":
                        self._write(conn, [item], {})
                    else:
                        self._write(conn, [], dict([item]))
            except _TRANSIENT:
                rest = items[i:]
                self._keep([r for k, r in rest if k == "stats"], dict(kv for k, kv in rest if k == "last"))
                raise
            except Exception as err:
                self._reject(kind, item if kind == "stats" else {"job": item[0][0], "rank": item[0][1], **item[1]}, err)

    def bound(self) -> None:
        """Keep at most the newest rows the buffer holds while writes fail (the oldest go first)."""
        self._keep([], {})

    def _keep(self, rows: list[dict[str, Any]], last: dict[tuple[str, int], LastStepRow]) -> None:
        with self._buf_lock:
            # Oldest first, within the buffer's bound.
            self._pending = (rows + self._pending)[-self.max_buffered * 4 :]
            for key, r in last.items():
                self._pending_last.setdefault(key, r)

    def _reject(self, kind: str, row: dict[str, Any], err: Exception) -> None:
        self.rejected += 1
        self.set_aside.append((kind, row))
        log.error("the store refused a statistics row; set aside, not retried: %s: %s; row %r", type(err).__name__,
                  str(err).splitlines()[0] if str(err) else "", row)  # fmt: skip
        if self.on_rejected is not None:
            self.on_rejected()
