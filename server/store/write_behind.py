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
import functools
import logging
import threading
from collections.abc import Callable
from typing import Literal, TypeAlias

from sqlalchemy import Connection, text

from rematd.server.store.columns import Params, dumps
from rematd.server.store.conflicts import Transactions
from rematd.server.store.database import STORE_AWAY
from rematd.server.store.rows import LastStepRow
from rematd.server.store.tables import STATS

log = logging.getLogger("rematd.server")

_INSERT = text(STATS.insert())
Last: TypeAlias = dict[tuple[str, int], LastStepRow]
"""Each rank's newest step, by (job, rank)."""
# One thing to write on its own: a step's row, or a rank's newest step.
_Item: TypeAlias = tuple[Literal["stats"], Params] | tuple[Literal["last"], tuple[tuple[str, int], LastStepRow]]

# Errors of the database itself, not of what was written: worth another try, the rows are kept.
_TRANSIENT = STORE_AWAY


class WriteBehind:
    """Buffered statistics rows and the latest row per rank, flushed together."""

    def __init__(self, transactions: Transactions, max_buffered: int) -> None:
        self.max_buffered = max_buffered
        self._transactions = transactions
        self._pending: list[Params] = []
        self._pending_last: Last = {}
        self._flush_lock = threading.Lock()
        # The buffer has its own lock: the event loop appends to it and must never wait on a database write.
        self._buf_lock = threading.Lock()
        self._in_flight = False
        """Rows taken out of the buffer are being written (under ``_flush_lock``): the buffer is not idle."""
        self.rejected = 0
        """Rows the database refused, set aside."""
        self.set_aside: collections.deque[tuple[str, Params]] = collections.deque(maxlen=100)
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
        values = STATS.values({**row, "job": job, "rank": rank})
        with self._buf_lock:
            self._pending.append(values)
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
                self._transactions.run(lambda conn: self._write(conn, rows, last))
            except _TRANSIENT:
                self._keep(rows, last)
                raise
            except Exception:
                self._write_each(rows, last)
            finally:
                with self._buf_lock:
                    self._in_flight = False

    def _write(self, conn: Connection, rows: list[Params], last: Last) -> None:
        if rows:
            conn.execute(_INSERT, rows)
        if not last:
            return
        newest: dict[str, LastStepRow] = {}
        for (j, _k), r in last.items():
            if j not in newest or r["time"] > newest[j]["time"]:
                newest[j] = r
        # Jobs' rows before ranks' rows, each in key order, as a hello takes them: two processes writing one
        # job's rows at once wait for each other, never deadlock.
        conn.execute(
            text("UPDATE jobs SET updated_at=:updated_at, budget_bytes=:budget_bytes WHERE job=:job"),
            [
                {"job": j, "updated_at": newest[j]["time"], "budget_bytes": newest[j]["budget_bytes"]}
                for j in sorted(newest)
            ],
        )
        conn.execute(
            text("UPDATE ranks SET last_stats=:last_stats WHERE job=:job AND rank=:rank"),
            [{"last_stats": dumps(last[key]), "job": key[0], "rank": key[1]} for key in sorted(last)],
        )

    def _write_one(self, conn: Connection, *, item: _Item) -> None:
        if item[0] == "stats":
            self._write(conn, [item[1]], {})
        else:
            self._write(conn, [], dict([item[1]]))

    def _write_each(self, rows: list[Params], last: Last) -> None:
        items: list[_Item] = [("stats", r) for r in rows]
        # Oldest first, so a job's updated_at only moves forward.
        items += [("last", kv) for kv in sorted(last.items(), key=lambda kv: kv[1]["time"])]
        for i, item in enumerate(items):
            try:
                self._transactions.run(functools.partial(self._write_one, item=item))
            except _TRANSIENT:
                rest = items[i:]
                self._keep([r[1] for r in rest if r[0] == "stats"], dict(r[1] for r in rest if r[0] == "last"))
                raise
            except Exception as err:
                if item[0] == "stats":
                    self._reject("stats", item[1], err)
                else:
                    (job, rank), row = item[1]
                    self._reject("last", {"job": job, "rank": rank, **row}, err)

    def bound(self) -> None:
        """Keep at most the newest rows the buffer holds while writes fail (the oldest go first)."""
        self._keep([], {})

    def _keep(self, rows: list[Params], last: Last) -> None:
        with self._buf_lock:
            # Oldest first, within the buffer's bound.
            self._pending = (rows + self._pending)[-self.max_buffered * 4 :]
            for key, r in last.items():
                self._pending_last.setdefault(key, r)

    def _reject(self, kind: str, row: Params, err: Exception) -> None:
        self.rejected += 1
        self.set_aside.append((kind, row))
        log.error("the store refused a statistics row; set aside, not retried: %s: %s; row %r", type(err).__name__,
                  str(err).splitlines()[0] if str(err) else "", row)  # fmt: skip
        if self.on_rejected is not None:
            self.on_rejected()
