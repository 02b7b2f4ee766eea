"""What the controller learned survives a restart of the service: a rank that reconnects to a new process
gets the decisions it would have got from the old one, not a relearning by oscillation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rematd.planner import Controller, ControllerConfig
from rematd.planner.messages import observation, open_planner
from rematd.server.core.advisor import AdvisorCore, RankSession
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store

from .test_service import hello, stats


def _changes(core: AdvisorCore, session: RankSession, first: int, last: int) -> list[tuple[int, int, str]]:
    out = []
    for step in range(first, last):
        plan = core.on_stats(session, stats(step, 6000, seq=128))
        if plan is not None:
            out.append((step, len(plan.blocks), plan.reason.split(":")[0]))
    return out


def _reconnect(core: AdvisorCore, sent: object) -> RankSession:
    again = dataclasses.replace(hello(job="learn"), plan_version=sent.version, plan=sent)  # type: ignore[attr-defined]
    session, _ = core.open_session(again)
    return session


def test_a_restarted_service_continues_what_the_controller_learned(tmp_path: Path) -> None:
    # The reference never restarts.
    ref_core = AdvisorCore(Store(tmp_path / "ref.db"), Metrics())
    ref, _ = ref_core.open_session(hello(job="learn"))
    # This one is replaced by a new process after the first step.
    old_core = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    old, _ = old_core.open_session(hello(job="learn"))
    for core, session in ((ref_core, ref), (old_core, old)):
        tightened = core.on_stats(session, stats(0, 9500, seq=128))  # over the target: tighten at once
        assert tightened is not None and "tighten" in tightened.reason
    sent = old.sent
    old_core.close_session(old, ended=False)
    old_core.store.close()

    restarted_core = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    restarted = _reconnect(restarted_core, sent)
    expected = _changes(ref_core, ref, 1, 400)
    assert expected and expected[0][2] == "loosen", expected
    assert _changes(restarted_core, restarted, 1, 400) == expected
    assert restarted.sent.version == ref.sent.version

    # Without what was learned (a store from before it was kept), the new process loosens far sooner.
    amnesiac_core = AdvisorCore(Store(tmp_path / "amnesiac.db"), Metrics())
    amnesiac = _reconnect(amnesiac_core, sent)
    forgot = _changes(amnesiac_core, amnesiac, 1, 400)
    assert forgot and forgot[0][0] < expected[0][0], (forgot, expected)


def test_controller_state_round_trips_and_bad_state_is_refused() -> None:
    session = open_planner(hello(job="learn"))
    controller = session.controller
    session.observe(observation(hello(job="learn"), stats(0, 9500, seq=128)))
    state = controller.export_state()
    fresh = Controller(controller.profile, ControllerConfig())
    fresh.restore_state(state)
    assert fresh.export_state() == state
    before = fresh.export_state()
    for bad in ({"v": 2}, {"v": 1, "dwell": -1}, {"v": 1, "dwell": 5, "buckets": [[128, ["x"], 1, 1, 0, None]]}):
        with pytest.raises(ValueError, match="state"):
            fresh.restore_state(bad)
        assert fresh.export_state() == before, "a refused state changes nothing"
