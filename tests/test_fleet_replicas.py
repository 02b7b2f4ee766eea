"""Two replicas of ``rematd serve`` on one real PostgreSQL (started by the test): the client's channel spreads a
job's ranks over both (round_robin over the addresses of its target), and when one replica is SIGKILLed every
rank reaches the survivor, continues its plan history, loses no step acknowledged before the last flush, and
the survivor's REST API and /metrics show the whole job."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from bench.served import Served, launch, stop
from rematd.client.service.stream_config import CHANNEL_OPTIONS
from rematd.server.config import StoreConfig

from .fleet_helpers import RawRank, job_view, metric
from .test_service_store import new_cluster, postgres_url  # noqa: F401  (a fixture)

TOKEN = "fleet-token-0123456789abcdef"
RANKS = 6


@pytest.fixture
def replicas(postgres_url: str) -> Iterator[list[Served]]:  # noqa: F811
    started: list[Served] = []
    try:
        for _ in range(2):
            started.append(launch(postgres_url, "--log-level", "warning", env={"REMATD_TOKEN": TOKEN}))
        yield started
    finally:
        for srv in started:
            stop(srv.proc)


def _holders(https: list[httpx.Client], job: str) -> dict[int, int]:
    """Which replica (its index) holds each rank's stream, from their REST views."""
    held: dict[int, int] = {}
    for i, http in enumerate(https):
        for v in job_view(http, job)["ranks"]:  # type: ignore[attr-defined]
            if v["served_here"]:
                held[v["rank"]] = i
    return held


def _stored_steps(http: httpx.Client, job: str, rank: int) -> set[int]:
    r = http.get(f"/api/v1/jobs/{job}/stats", params={"rank": rank, "limit": 10_000})
    assert r.status_code == 200, r.text
    return {row["step"] for row in r.json()["stats"]}


def test_ranks_spread_over_two_replicas_and_fail_over_to_the_survivor(replicas: list[Served]) -> None:
    target = "ipv4:" + ",".join(srv.grpc for srv in replicas)
    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=30)
    https = [
        httpx.Client(base_url=srv.http, timeout=20, headers={"authorization": f"Bearer {TOKEN}"}) for srv in replicas
    ]
    ranks = [RawRank(target, "fleet", r, RANKS, token=TOKEN, channel=channel) for r in range(RANKS)]
    try:
        for rank in ranks:
            rank.connect()
            rank.step()
        for _ in range(4):
            for rank in ranks:
                rank.step()
        held = _holders(https, "fleet")
        assert sorted(held) == list(range(RANKS))
        assert set(held.values()) == {0, 1}, f"the ranks spread over both replicas: {held}"

        victim, survivor = 1, 0
        moved = [r for r in ranks if held[r.rank] == victim]
        versions = {r.rank: r.plan_version for r in ranks}
        killed_at = time.monotonic()
        os.kill(replicas[victim].proc.pid, signal.SIGKILL)
        replicas[victim].proc.wait(10)
        deadline = killed_at + 15
        for rank in ranks:
            rank.step_or_reconnect(deadline)
        assert time.monotonic() < deadline, "every rank streams to the survivor within 15 s"
        for _ in range(3):
            for rank in ranks:
                rank.step()

        http = https[survivor]
        view = job_view(http, "fleet")
        shown = {v["rank"]: v for v in view["ranks"]}  # type: ignore[attr-defined]
        assert all(shown[r.rank]["state"] == "connected" and shown[r.rank]["served_here"] for r in ranks), shown
        text = http.get("/metrics").text
        assert metric(text, 'rematd_job_connected_ranks{job="fleet"}') == RANKS
        assert metric(text, 'rematd_job_world_size{job="fleet"}') == RANKS
        # Plan history continues: no version went back (RawRank checks every plan it reads), and the store has
        # each rank's plans in order.
        plans = http.get("/api/v1/jobs/fleet/plans", params={"limit": 1000}).json()["plans"]
        for rank in ranks:
            own = [p["version"] for p in plans if p["rank"] == rank.rank]
            assert own == sorted(own) and own[-1] >= versions[rank.rank], (rank.rank, own)
        # No acknowledged step lost: those acknowledged before the victim's last flush, and all since.
        flushed_before = killed_at - 4 * StoreConfig().flush_seconds
        for rank in ranks:
            stored = _stored_steps(http, "fleet", rank.rank)
            durable = {step for step, at in rank.acked if at < flushed_before or at > killed_at}
            assert durable <= stored, (rank.rank, sorted(durable - stored))
        assert moved, "the victim held ranks"
    finally:
        for rank in ranks:
            rank.close()
        channel.close()
        for h in https:
            h.close()


def test_readiness_fails_while_postgresql_is_unreachable_and_returns_with_it() -> None:
    cluster = new_cluster()
    try:
        cluster.start()
        srv = launch(cluster.create(), "--log-level", "warning")
        try:
            with httpx.Client(base_url=srv.http, timeout=20) as http:
                assert http.get("/readyz").status_code == 200
                cluster.stop()  # nothing writes meanwhile: only readiness's own probe can notice
                r = _wait_status(http, 503)
                assert r.status_code == 503 and "cannot be written" in r.json()["detail"], r.text
                assert http.get("/healthz").status_code == 200, "alive: a restart would not bring the database back"
                cluster.start()
                assert _wait_status(http, 200).status_code == 200
        finally:
            stop(srv.proc)
    finally:
        cluster.remove()


def test_readiness_fails_while_postgresql_takes_no_new_connections() -> None:
    import psycopg

    from bench.postgres import Cluster, pg_bin

    if pg_bin() is None:
        pytest.skip("PostgreSQL binaries are absent (Debian package 'postgresql', see scripts/system-packages.txt)")
    # Few connections, none kept for superusers: the test takes every one the service is not holding.
    cluster = Cluster(str(pg_bin()), "max_connections=10", "superuser_reserved_connections=0")
    held: list[psycopg.Connection] = []
    try:
        cluster.start()
        srv = launch(cluster.create(), "--log-level", "warning", env={"REMATD_TOKEN": TOKEN})
        try:
            with httpx.Client(base_url=srv.http, timeout=20) as http:
                assert http.get("/readyz").status_code == 200
                while True:
                    try:
                        held.append(psycopg.connect(f"host={cluster.sock} user=postgres dbname=rematd"))
                    except psycopg.OperationalError as err:
                        assert "too many clients" in str(err), err
                        break
                # The service's pooled connection still writes; a hello that needs another cannot be served.
                r = _wait_status(http, 503)
                assert r.status_code == 503 and "too many clients" in r.json()["detail"], r.text
                time.sleep(2.5)  # several probes later: it stays so
                assert http.get("/readyz").status_code == 503
                for conn in held:
                    conn.close()
                held.clear()
                assert _wait_status(http, 200).status_code == 200
                rank = RawRank(srv.grpc, "after-the-crowd", 0, 1, token=TOKEN)
                rank.connect()
                assert rank.plan_version >= 1
                rank.close()
        finally:
            stop(srv.proc)
    finally:
        for conn in held:
            conn.close()
        cluster.remove()


def _wait_status(http: httpx.Client, status: int, seconds: float = 20.0) -> httpx.Response:
    deadline = time.monotonic() + seconds
    while True:
        r = http.get("/readyz")
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_a_rank_live_on_one_replica_is_refused_on_the_other_until_its_stream_ends(replicas: list[Served]) -> None:
    """A restarted trainer that reaches the other replica before its old stream has ended, with the job's own
    credential: refused there (ABORTED, the holder named, which the client retries quietly) while the first
    replica's stream lives, and taken once it has ended, its plan versions going on above every stored one, none
    stored twice."""
    http = httpx.Client(base_url=replicas[1].http, timeout=20, headers={"authorization": f"Bearer {TOKEN}"})
    first = RawRank(replicas[0].grpc, "forked", 0, 1, token=TOKEN)
    second = RawRank(replicas[1].grpc, "forked", 0, 1, token=TOKEN)
    try:
        first.connect()
        for _ in range(3):
            first.step()
        with pytest.raises(grpc.RpcError) as refused:
            second.connect()
        assert refused.value.code() == grpc.StatusCode.ABORTED, refused.value
        assert "is held by" in (refused.value.details() or ""), refused.value.details()
        first.step(peak=10**12)  # the first replica still serves it: a step far over the budget tightens
        first.close()
        deadline = time.monotonic() + 15
        while True:
            try:
                second.connect()
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.ABORTED and time.monotonic() < deadline, err
                time.sleep(0.2)
        second.step()
        second.step(peak=10**12)
        assert min(second.plan_versions) > max(first.plan_versions), (first.plan_versions, second.plan_versions)
        plans = http.get("/api/v1/jobs/forked/plans", params={"limit": 1000}).json()["plans"]
        versions = [p["version"] for p in plans if p["rank"] == 0]
        assert len(versions) == len(set(versions)), sorted(versions)
    finally:
        first.close()
        second.close()
        http.close()
