"""An HTTP/2 rapid-reset flood (streams opened and cancelled at once, thousands a second, on one connection)
against a real ``rematd serve``: the transport refuses the streams over ``--max-streams-per-connection`` before
the service sees them, and trainers on other connections say hello as usual meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.served import Served, launch, stop

from .fleet_helpers import RawRank
from .http2_flood import RapidReset

TOKEN = "rapid-reset-token-0123456789"
REFUSED_STREAM = 0x7


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    srv = launch(tmp_path / "r.db", "--log-level", "warning", env={"REMATD_TOKEN": TOKEN})
    try:
        yield srv
    finally:
        stop(srv.proc)


def test_a_rapid_reset_flood_is_refused_and_trainers_go_on(server: Served) -> None:
    host, port = server.grpc.rsplit(":", 1)
    attacker = RapidReset(host, int(port), "/rematd.v1.Advisor/Session")
    hellos: list[tuple[str, float]] = []

    def trainers() -> None:
        for rank in range(8):
            began = time.monotonic()
            trainer = RawRank(server.grpc, "beside-a-flood", rank, 8, token=TOKEN)
            try:
                trainer.connect(timeout=10)
                hellos.append(("ok", time.monotonic() - began))
            except Exception as err:  # what the trainer was told, for the assertion below
                hellos.append((repr(err)[:300], time.monotonic() - began))
            finally:
                trainer.close()
            time.sleep(0.3)

    beside = threading.Thread(target=trainers, name="trainers")
    beside.start()
    try:
        sent = attacker.flood(20_000, 4.0)
    finally:
        beside.join(60)
        attacker.close()
    assert sent == 20_000
    # Each batch opens 200 streams before resetting them: those over the bound were refused by the transport,
    # not handed to the service.
    assert attacker.resets[REFUSED_STREAM] > 0, attacker.resets
    assert [h for h, _ in hellos] == ["ok"] * 8, hellos
    with httpx.Client(base_url=server.http, timeout=10) as http:
        assert http.get("/healthz").status_code == 200
        assert http.get("/readyz").status_code == 200
