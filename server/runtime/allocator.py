"""Giving freed memory back to the system: what a flood of large rejected messages leaves behind is freed
at once (no reference cycle holds it), but glibc's allocator keeps the pages, spread over one arena per
thread that converted a message. Eight threads of rejected 1 MiB hellos left 428 MiB resident, none of it
in use. Fewer arenas, and a trim after the collections that follow ended streams, return it."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger("rematd.server")

MAX_ARENAS = 4
"""glibc malloc arenas (its default is eight per core): fewer places for freed pages to hide."""
_M_ARENA_MAX = -8

_libc: ctypes.CDLL | None = None
try:
    _name = ctypes.util.find_library("c")
    _candidate = ctypes.CDLL(_name) if _name else None
    if _candidate is not None and hasattr(_candidate, "malloc_trim") and hasattr(_candidate, "mallopt"):
        _libc = _candidate
except OSError:  # not glibc (musl, macOS): nothing to tune
    _libc = None


def limit_arenas(arenas: int = MAX_ARENAS) -> bool:
    """Cap glibc's malloc arenas; at start, before threads allocate. False where the allocator is not glibc's."""
    return _libc is not None and bool(_libc.mallopt(_M_ARENA_MAX, arenas))


def give_back() -> bool:
    """Return the free pages of every arena to the system; False where it cannot."""
    return _libc is not None and bool(_libc.malloc_trim(0))


_soon: threading.Timer | None = None
_soon_lock = threading.Lock()


def give_back_soon(delay: float = 0.5) -> None:
    """:func:`give_back` once, ``delay`` seconds from now (on a thread of its own): after a large answer is
    sent and its rows freed. Calls before it runs join it."""
    global _soon
    with _soon_lock:
        if _soon is not None:
            return
        _soon = threading.Timer(delay, _give_back_now)
        _soon.daemon = True
        _soon.start()


def _give_back_now() -> None:
    global _soon
    with _soon_lock:
        _soon = None
    give_back()
