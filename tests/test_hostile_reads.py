"""Large reads against a real ``rematd serve``: a read of statistics is bounded in rows, many at once leave
little memory behind, and a reader that stops reading (a zero TCP window) is cut off, its descriptor freed."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from bench.hostile_calls import held_from
from bench.served import Served, launch, stop
from bench.store_rows import more_plans, more_steps
from rematd import wire
from rematd.server.core.paging import MAX_ROWS_PAGE
from rematd.server.core.views import MODES_PER_BLOCK, PAGE_MODES
from rematd.server.transport import rest_reads
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_hostile_input import rss_bytes
from .test_service import hello, stats

RESPONSE_SECONDS = 2.0
ROWS = 20_000
WIDE_PLANS = 500
"""Plans of a job of 256 blocks, each with a per-length table: a page of them is some 8 MiB of JSON, more than
the kernel's socket buffers take for a reader that does not read."""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    db = tmp_path_factory.mktemp("reads") / "r.db"
    srv = launch(db, "--log-level", "error", "--http-response-seconds", str(RESPONSE_SECONDS))
    try:
        with grpc.insecure_channel(srv.grpc) as ch:
            for h in (hello(job="long"), hello(job="wide", n=256)):
                msgs = [
                    pb.ClientMessage(hello=wire.hello_to_pb(h)),
                    pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 500))),
                    pb.ClientMessage(goodbye=pb.Goodbye()),
                ]
                list(pb_grpc.AdvisorStub(ch).Session(iter(msgs), timeout=10))
        assert httpx.get(f"{srv.http}/api/v1/jobs/long/stats", timeout=10).json()["stats"]  # flushed
        more_steps(db, "long", ROWS)
        more_plans(db, "wide", 256, WIDE_PLANS)
        yield srv
    finally:
        stop(srv.proc)


def test_a_read_of_statistics_is_bounded_and_many_leave_little_behind(served: Served) -> None:
    url = f"{served.http}/api/v1/jobs/long/stats"
    refused = httpx.get(url, params={"limit": 100_000}, timeout=10)
    assert refused.status_code == 422 and "limit" in refused.text
    assert len(httpx.get(url, params={"limit": MAX_ROWS_PAGE}, timeout=30).json()["stats"]) == MAX_ROWS_PAGE
    time.sleep(1)
    before = rss_bytes(served.proc.pid)
    sizes: list[int] = []

    def read() -> None:
        for _ in range(2):
            # A read that waited its turn too long is told to try again (503), as a loaded machine may make one.
            for _ in range(10):
                answer = httpx.get(url, params={"limit": MAX_ROWS_PAGE}, timeout=60)
                if answer.status_code != 503:
                    break
                assert "try again" in answer.text and answer.headers["retry-after"]
            sizes.append(len(answer.content))

    readers = [threading.Thread(target=read) for _ in range(16)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(120)
    assert len(sizes) == 32 and min(sizes) > 1 << 20
    time.sleep(1.5)
    left = rss_bytes(served.proc.pid) - before
    # 32 answers of some 2 MiB, made two at a time: what is left is a few answers' worth, not 32.
    assert left < 48 << 20, f"{left >> 20} MiB left behind"


def test_a_reader_that_stops_reading_is_cut_off(served: Served) -> None:
    host, port = served.http.removeprefix("http://").rsplit(":", 1)
    url = f"/api/v1/jobs/wide/plans?limit={WIDE_PLANS}"
    assert len(httpx.get(served.http + url, timeout=60).content) > 6 << 20
    stalled = []
    try:
        for _ in range(8):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a window that closes at once
            s.connect((host, int(port)))
            s.sendall(f"GET {url} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            stalled.append(s)
        clients = {s.getsockname()[1] for s in stalled}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and held_from(served.proc.pid, clients) < 8:
            time.sleep(0.05)
        assert held_from(served.proc.pid, clients) == 8, "the stalled reads were not taken"
        # Each is cut off once it has taken nothing for RESPONSE_SECONDS, whatever it does.
        deadline = time.monotonic() + RESPONSE_SECONDS + 30
        while time.monotonic() < deadline and held_from(served.proc.pid, clients):
            time.sleep(0.2)
        assert held_from(served.proc.pid, clients) == 0, "stalled readers still hold their descriptors"
        assert httpx.get(f"{served.http}/healthz", timeout=10).status_code == 200
    finally:
        for s in stalled:
            s.close()


def test_a_page_of_a_wide_models_plans_holds_fewer_plans_and_says_where_the_next_starts(served: Served) -> None:
    url = f"{served.http}/api/v1/jobs/wide/plans"
    page = httpx.get(url, params={"limit": 10_000}, timeout=60).json()
    most = PAGE_MODES // (256 * MODES_PER_BLOCK)
    assert len(page["plans"]) == most and page["next_cursor"]
    seen = [p["version"] for p in page["plans"]]
    while page["next_cursor"]:
        page = httpx.get(url, params={"limit": 10_000, "cursor": page["next_cursor"]}, timeout=60).json()
        assert len(page["plans"]) <= most
        seen += [p["version"] for p in page["plans"]]
    assert len(seen) == WIDE_PLANS + 1 and seen == sorted(seen)


def test_a_list_read_waits_its_turn_then_is_told_to_try_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer holds its turn until it is delivered (or dropped): the next read waits, then gets 503."""
    monkeypatch.setattr(rest_reads, "LIST_WAIT_SECONDS", 0.2)
    lists = rest_reads.Lists(at_once=1)
    first = lists.answer(lambda: {"rows": list(range(10))})
    assert first.status_code == 200
    waited = lists.answer(lambda: {"rows": []})
    assert waited.status_code == 503 and waited.headers["retry-after"] == "5"
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def receive() -> dict[str, object]:
        return {"type": "http.disconnect"}

    asyncio.run(first({"type": "http"}, receive, send))
    assert b"[0,1,2" in sent[-1]["body"]  # type: ignore[operator]
    assert lists.answer(lambda: {"rows": []}).status_code == 200  # delivered: its turn is back
    dropped = lists.answer(lambda: {"rows": []})
    del dropped  # never sent (its request given up): its turn is back too
    assert lists.answer(lambda: {"rows": []}).status_code == 200
