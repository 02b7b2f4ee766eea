"""Memory freed after rejected streams, and the profile cache emptied as jobs end."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.rejected_streams import measure
from rematd.planner import Shape, shapes
from rematd.planner.messages import BlockProfile, Hello
from rematd.server.core import sessions as sessions_mod
from rematd.server.core.advisor import AdvisorCore
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store

from .helpers import live_server

# The figure the service holds to: 1,000 rejected streams cost at most this much RSS.
BOUND_PER_1000_MIB = 50.0


def test_rejected_streams_free_their_memory(tmp_path: Path) -> None:
    """200 refused 0.9 MiB hellos against a real ``rematd serve``, after 200 that bring the process to its
    working size: the growth per stream implies 1,000 streams stay within the bound (``python -m
    bench.rejected_streams`` runs the full 1,000). The first streams raise RSS by the garbage awaiting the
    next full collection (about 14 MiB, then flat), which is not a leak: the warm-up takes it out of the
    per-stream figure, and the growth from the start still counts it."""
    with live_server(tmp_path) as srv:
        got = measure(srv.grpc, srv.proc.pid, streams=200, warmup=200)
    assert got["message_bytes"] > 800_000
    assert got["growth_per_stream_kib"] * 1000 / 1024 < BOUND_PER_1000_MIB, got
    assert got["growth_from_start_mib"] < BOUND_PER_1000_MIB, got


def _profile_hello(job: str, n: int, seed: int) -> Hello:
    return Hello(
        job_id=job,
        blocks=tuple(
            BlockProfile(index=i, name=f"b{i}", saved_bytes=1000 + seed, input_bytes=100, forward_seconds=0.01)
            for i in range(n)
        ),
        profile_shape=Shape(batch=1, seq_len=32, tokens=32),
        budget_bytes=10**9,
        model_fingerprint=f"model-{seed}",
    )


def test_the_profile_cache_is_bounded_in_bytes_and_emptied_as_jobs_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions_mod, "MAX_INTERNED_BYTES", 200 * 1024)
    core = AdvisorCore(Store(":memory:"), Metrics())
    sessions = []
    for k in range(12):
        session, _ = core.open_session(_profile_hello(f"job-{k}", 64, k))
        sessions.append(session)
        assert core.sessions.interned_bytes <= sessions_mod.MAX_INTERNED_BYTES
    profiles = [s.planner.profile for s in sessions]
    # Ranks of one model still share: a second rank of job-0 gets job-0's copy.
    again = dataclasses.replace(_profile_hello("job-0", 64, 0), session_secret=sessions[0].secret)
    other, _ = core.open_session(again)
    assert other.planner.profile is profiles[0]
    assert any(v.profile is profiles[0] for v in shapes._CACHE.values())
    for s in [*sessions, other]:
        core.close_session(s, ended=True)
    assert core.sessions.interned == {} and core.sessions.interned_bytes == 0
    assert not any(v.profile is p for v in shapes._CACHE.values() for p in profiles)
