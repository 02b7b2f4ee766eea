"""A plan's reason says in an operator's words what changed at which lengths and why; "loosen" recomputes less."""

from __future__ import annotations

import itertools
import re

from rematd.planner import Mode, Plan, Shape, ShapePlan, StepObservation
from rematd.planner.messages import open_planner
from rematd.planner.reasons import recomputes_less, what_changed

from .test_plan_rows import modes_hello

WEIGHT = {".": 0, "O": 0, "s": 1, "R": 2}
CODE = {".": Mode.STORE, "s": Mode.SELECTIVE, "R": Mode.RECOMPUTE, "O": Mode.OFFLOAD}


def entry(seq: int, letters: str) -> ShapePlan:
    return ShapePlan(
        max_seq_len=seq,
        max_tokens=seq,
        modes=tuple(CODE[c] for c in letters),
        predicted_peak_bytes=0,
        predicted_overhead_ratio=0.0,
    )


def test_more_recomputation_is_never_called_loosening() -> None:
    # As seen against a real service: length 160 went from RRRsRRRs to RRRRRRRR under a "loosen" label.
    assert not recomputes_less((entry(160, "RRRsRRRs"),), (entry(160, "RRRRRRRR"),))
    assert not recomputes_less((entry(160, "RRRsRRRs"),), (entry(160, "RRRsRRRs"),)), "the same blocks"
    assert recomputes_less((entry(160, "RRRRRRRR"),), (entry(160, "RRRsRRRs"),))
    assert recomputes_less((entry(160, "RRRRRRRR"),), (entry(160, "OOOOOOOO"),)), "offloading recomputes nothing"
    assert not recomputes_less(
        (entry(64, "s.s.s.s."), entry(160, "RRRsRRRs")), (entry(64, "........"), entry(160, "RRRRRRRR"))
    ), "less at one length, more at another"


def test_what_changed_names_the_lengths_in_the_demos_letters() -> None:
    said = what_changed(
        (entry(64, "........"), entry(160, "RRRsRRRs")), (entry(64, "........"), entry(160, "RRRRRRRR"))
    )
    assert said.startswith("length <= 160: RRRsRRRs -> RRRRRRRR") and "length <= 64" not in said
    assert "R recompute" in said
    added = what_changed((entry(64, "........"),), (entry(64, "........"), entry(724, "RRRRRRRR")))
    assert "length <= 724: RRRRRRRR (new)" in added


def _weights(plan: Plan) -> dict[int, int]:
    letters = {Mode.STORE: ".", Mode.SELECTIVE: "s", Mode.RECOMPUTE: "R", Mode.OFFLOAD: "O"}
    return {e.max_seq_len: sum(WEIGHT[letters[m]] for m in e.modes) for e in plan.shape_plans}


def given_peaks_plans(job: str) -> list[Plan]:
    """Every plan of a session whose steps' peaks are given, not measured (the same plans on any machine):
    lengths that grow past the target, shrink with room, grow again and shrink further."""
    session = open_planner(modes_hello(job))
    plans = [session.plan]
    pattern = [(128, 9800)] * 3 + [(256, 9900)] * 2 + [(128, 3000)] * 120 + [(300, 9900)] * 2 + [(64, 2000)] * 120
    for step, (seq, peak) in enumerate(pattern):
        obs = StepObservation(
            step=step,
            peak_bytes=peak,
            budget_bytes=10_000,
            static_bytes=0,
            plan_version=session.plan.version,
            shape=Shape(batch=1, seq_len=seq, tokens=seq),
        )
        if session.observe(obs) is not None:
            plans.append(session.plan)
    return plans


def test_every_change_of_a_session_says_what_changed_and_loosens_only_by_recomputing_less() -> None:
    plans = given_peaks_plans("reasons")
    labels = [p.reason.split(":", 1)[0] for p in plans[1:]]
    assert "tighten" in labels and "loosen" in labels, [p.reason for p in plans]
    for before, after in itertools.pairwise(plans):
        reason = after.reason
        assert "extend the plan table" not in reason and "seq " not in reason, reason
        assert re.search(r"length <= \d+: [.sRO]+ (-> [.sRO]+|\(new\))", reason), reason
        if reason.startswith("loosen"):
            was, now = _weights(before), _weights(after)
            common = [seq for seq in now if seq in was]
            assert all(now[seq] <= was[seq] for seq in common), (reason, was, now)
            assert any(now[seq] < was[seq] for seq in common), (reason, was, now)
        if reason.startswith("new sequence length"):
            assert re.match(r"new sequence length \d+: plans added for lengths up to \d+", reason), reason
