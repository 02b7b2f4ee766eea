"""Whether the SQLite file the store was opened on is still there, the same file, and still a database.

An open SQLite connection goes on writing to a file deleted under it (the rows land in an inode no
name reaches), and one opened after the file was replaced writes into the new, empty file: either
way the store is lost while every write succeeds. The file's identity (device and inode) is kept
at start and checked, with its header, on the writer's schedule: one ``stat`` and a 16-byte read.

The store's journal (``-wal``) is named after the path, not the file: left beside a file that took the
path, it is replayed into that file by whoever opens it next (another application's database was
left "malformed"). So a store whose file moved away empties its journal into its own file at once
(:class:`Keeper`), and a start refuses a journal beside a file that is not rematd's
(:func:`foreign_under_journal`) without letting SQLite open either.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3

from sqlalchemy import make_url

from rematd.server.store.database import StoreError

_HEADER = b"SQLite format 3\x00"


def sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names; None for another database or one in memory."""
    if not url.startswith("sqlite"):
        return None
    database = make_url(url).database
    return database if database and database != ":memory:" else None


class FileWatch:
    """The store's file as it was opened, and what became of it."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Held open for as long as the store is, and read with pread: closing a descriptor of the database
        # file drops every POSIX lock this process holds on it, SQLite's included, and another process (a
        # worker, a tool) then took itself for the last reader, checkpointed, and removed the journal under
        # this one's connections, which read "database disk image is malformed" from then on.
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(self._fd)
        self.identity = (st.st_dev, st.st_ino)
        self.moved = False
        """The file the store opened is no longer at its path (deleted, moved away, replaced)."""

    def problem(self) -> str:
        """Why the file is not the store any more, or "" while it is."""
        self.moved = False
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.moved = True
            return f"the database file {self.path} was deleted while the service used it"
        except OSError as err:
            return f"the database file {self.path} cannot be examined: {err.strerror}"
        if (st.st_dev, st.st_ino) != self.identity:
            self.moved = True
            return f"the database file {self.path} was replaced by another file while the service used it"
        try:
            header = os.pread(self._fd, len(_HEADER), 0)
        except OSError as err:
            return f"the database file {self.path} cannot be read: {err.strerror}"
        if header != _HEADER:
            return f"the database file {self.path} was truncated or overwritten while the service used it"
        return ""

    def close(self) -> None:
        """Let go of the file: only once the store's connections are closed (see ``__init__``)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Keeper:
    """A connection of the store's own, held open on the file it opened (wherever its name goes), to empty
    the journal into that file once the file has moved away: what the journal holds is the store's, and the
    path's next file must not get it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # Opens the journal and its index now, on this file (not whatever the path names later).
        self._conn.execute("SELECT count(*) FROM sqlite_master").fetchone()

    def empty_journal(self) -> bool:
        """Copy the journal into the store's own file and truncate it to nothing; False if it could not."""
        try:
            busy, _, _ = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.Error:
            return False
        return not busy

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()


def foreign_under_journal(path: str) -> str:
    """Why the store must not be opened: a journal (``-wal``) beside a file that is not rematd's, which
    opening would replay into that file; "" otherwise. Read with SQLite told the file is immutable, so that
    neither file is touched."""
    journal = f"{path}-wal"
    try:
        if os.path.getsize(journal) == 0 or os.path.getsize(path) == 0:
            return ""
    except OSError:
        return ""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error:
        return ""
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables or "schema_version" in tables or {"meta", "jobs", "plans"} <= tables:
            return ""  # rematd's (or empty): the journal is its own, replayed as after any crash
    except sqlite3.Error:
        return ""  # not a database SQLite reads: opening it says why
    finally:
        conn.close()
    shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
    return (
        f"{path} is not a rematd store (it holds tables {shown}), and {journal} beside it is a journal that "
        "opening the file would replay into it, most likely the last writes of the rematd store that was "
        f"there before: both left untouched; move {journal} and {path}-shm away before anything opens {path}"
    )


def check_journal(path: str) -> None:
    """Raise StoreError when :func:`foreign_under_journal` finds a problem."""
    problem = foreign_under_journal(path)
    if problem:
        raise StoreError(problem)
