"""Whether the SQLite file the store was opened on is still there, the same file, and still a database.

An open SQLite connection goes on writing to a file deleted under it (the rows land in an inode no
name reaches), and one opened after the file was replaced writes into the new, empty file: either
way the store is lost while every write succeeds. The file's identity (device and inode) is kept
at start and checked, with its header, on the writer's schedule: one ``stat`` and a 16-byte read.
"""

from __future__ import annotations

import os

from sqlalchemy import make_url

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
        st = os.stat(path)
        self.identity = (st.st_dev, st.st_ino)

    def problem(self) -> str:
        """Why the file is not the store any more, or "" while it is."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return f"the database file {self.path} was deleted while the service used it"
        except OSError as err:
            return f"the database file {self.path} cannot be examined: {err.strerror}"
        if (st.st_dev, st.st_ino) != self.identity:
            return f"the database file {self.path} was replaced by another file while the service used it"
        try:
            with open(self.path, "rb") as f:
                header = f.read(len(_HEADER))
        except OSError as err:
            return f"the database file {self.path} cannot be read: {err.strerror}"
        if header != _HEADER:
            return f"the database file {self.path} was truncated or overwritten while the service used it"
        return ""
