from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rematd import wire
from rematd.planner import Plan, Shape
from rematd.records import MEMORY_CUDA, BlockRecord, Hello, OomReport, StepStats

ROOT = Path(__file__).resolve().parent.parent


def test_records_round_trip_through_protobuf() -> None:
    h = Hello(
        job_id="j",
        rank=1,
        world_size=2,
        device_name="H100",
        device_total_bytes=80 * 2**30,
        model_fingerprint="f",
        blocks=(BlockRecord(index=0, name="h.0", saved_bytes=5, input_bytes=1, forward_seconds=0.5),),
        profile_shape=Shape(batch=2, seq_len=3, tokens=6),
        budget_bytes=7,
        static_bytes=8,
        memory_source=MEMORY_CUDA,
        margin_ratio=0.25,
        client_version="x",
        plan_version=4,
    )
    assert wire.hello_from_pb(wire.hello_to_pb(h)) == h
    s = StepStats(step=3, peak_allocated_bytes=9, shape=Shape(batch=1, seq_len=2, tokens=2), step_seconds=0.25)
    assert wire.stats_from_pb(wire.stats_to_pb(s)) == s
    o = OomReport(step=2, shape=Shape(batch=1, seq_len=1, tokens=1), plan_version=3, message="boom")
    assert wire.oom_from_pb(wire.oom_to_pb(o)) == o
    p = Plan(
        version=2,
        blocks=(0, 2),
        checkpoint_every=2,
        predicted_peak_bytes=10,
        predicted_overhead_ratio=0.125,
        target_bytes=11,
        reason="r",
    )
    assert wire.plan_from_pb(wire.plan_to_pb(p)) == p


def test_generated_code_matches_the_proto() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_server_imports_without_torch_and_planner_without_anything() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import rematd.server, rematd.server.app, rematd.server.cli\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import rematd.planner\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "stdlib = set(sys.stdlib_module_names)\n"
        "print(sorted(new - stdlib - {'rematd'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
