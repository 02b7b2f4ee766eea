from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor

from rematd import wire
from rematd.planner import Mode, ModeCost, ModeSeconds, Plan, Shape, ShapePlan, Size, Term
from rematd.planner.messages import MEMORY_CUDA, BlockProfile, Hello, InvalidMessage, OomReport, StepStats

ROOT = Path(__file__).resolve().parent.parent


def test_records_round_trip_through_protobuf() -> None:
    h = Hello(
        job_id="j",
        rank=1,
        world_size=2,
        device_name="H100",
        device_total_bytes=80 * 2**30,
        model_fingerprint="f",
        blocks=(BlockProfile(index=0, name="h.0", saved_bytes=5, input_bytes=1, forward_seconds=0.5),),
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


def _init_fields(record: type) -> set[str]:
    return {f.name for f in dataclasses.fields(record) if f.init}


def test_every_wire_field_has_one_record_field_and_every_record_field_a_wire_field() -> None:
    renamed_seen = set()
    for record, message_type in wire.WIRE_RECORDS.items():
        message = message_type.DESCRIPTOR
        mapped = set()
        for f in message.fields:
            record_name, why = wire.RENAMED.get((message.name, f.name), (f.name, ""))
            if (message.name, f.name) in wire.RENAMED:
                renamed_seen.add((message.name, f.name))
                assert why, f"{message.name}.{f.name} is renamed without a reason"
            mapped.add(record_name)
        assert mapped == _init_fields(record), f"{record.__name__} ~ {message.full_name}"
    assert renamed_seen == set(wire.RENAMED), "a rename names a field that is not on the wire"


def _value(f: FieldDescriptor) -> Any:
    """A value for ``f`` unlike its default and its neighbours' (small: a term's exponents are at most 2 and 3)."""
    if f.cpp_type == f.CPPTYPE_STRING:
        return f"v{f.number}"
    if f.cpp_type in (f.CPPTYPE_DOUBLE, f.CPPTYPE_FLOAT):
        return f.number + 0.5
    if f.cpp_type == f.CPPTYPE_BOOL:
        return True
    return f.number


def _filled(record: type, **rest: Any) -> Any:
    """``record`` with every field copied by name set to a value unlike its default and every other."""
    plain = {f.name: f for f in wire.WIRE_RECORDS[record].DESCRIPTOR.fields if f.name in wire.COPIED[record]}
    return record(**({name: _value(f) for name, f in plain.items()} | rest))


def test_every_copied_field_reaches_the_wire_and_comes_back() -> None:
    size = Size((_filled(Term), _filled(Term)))
    # A share of the extra seconds, which the filled value of its field number would exceed.
    modes = (
        _filled(ModeCost, mode=Mode.STORE, kept=size, transient=size, fixed_seconds=1.25),
        _filled(ModeCost, mode=Mode.RECOMPUTE, kept=size, fixed_seconds=1.25),
    )
    shape_plan = _filled(ShapePlan, modes=(Mode.STORE, Mode.RECOMPUTE))
    plan = _filled(Plan, blocks=(1, 3), modes=(Mode.RECOMPUTE, Mode.STORE), shape_plans=(shape_plan,))
    hello = _filled(
        Hello,
        blocks=(_filled(BlockProfile, modes=modes),),
        profile_shape=_filled(Shape),
        memory_source=MEMORY_CUDA,
        other_activations=size,
        plan=plan,
    )
    stats = _filled(
        StepStats,
        shape=_filled(Shape),
        mode_seconds=(_filled(ModeSeconds, mode=Mode.SELECTIVE),),
        modes=(Mode.STORE, Mode.RECOMPUTE),
    )
    oom = _filled(OomReport, shape=_filled(Shape))
    for record, to_pb, from_pb in (
        (hello, wire.hello_to_pb, wire.hello_from_pb),
        (stats, wire.stats_to_pb, wire.stats_from_pb),
        (oom, wire.oom_to_pb, wire.oom_from_pb),
        (plan, wire.plan_to_pb, wire.plan_from_pb),
    ):
        msg = to_pb(record)  # type: ignore[operator]
        on_wire = {f.name for f, _ in msg.ListFields()}
        assert on_wire == {f.name for f in msg.DESCRIPTOR.fields}, f"{type(record).__name__} left fields unset"
        assert from_pb(type(msg).FromString(msg.SerializeToString())) == record  # type: ignore[operator]
    assert wire.stats_to_pb(stats).inactive_split_bytes == stats.inactive_split_bytes


def test_every_stats_count_is_validated() -> None:
    for name in wire.COPIED[StepStats]:
        value = getattr(StepStats(step=0, budget_bytes=1), name)
        bad = -1 if isinstance(value, int) else float("nan")
        with pytest.raises(InvalidMessage, match=rf"^stats\.{name}: "):
            dataclasses.replace(StepStats(step=0, budget_bytes=1), **{name: bad}).validate()


def test_the_wheel_builds_without_warnings_and_holds_every_module_and_data_file(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    for part in ("pyproject.toml", "README.md", "proto", "cli", "planner", "client", "server", "integrations"):
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, tree / part)
    # The venv's setuptools rather than a fresh one downloaded for the build: nothing leaves the machine.
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", "dist", "."],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "warning" not in (out.stdout + out.stderr).lower(), out.stdout + out.stderr
    (wheel,) = (tree / "dist").glob("rematd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    roots = {"proto/rematd": "rematd", "cli": "rematd/cli", "planner": "rematd/planner", "client": "rematd/client"}
    roots |= {"server": "rematd/server", "integrations": "rematd/integrations"}
    expected = {"rematd/py.typed", "rematd/v1/advisor.proto", "rematd/v1/advisor_pb2.pyi"}
    for src, dest in roots.items():
        for path in (ROOT / src).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".html") and "__pycache__" not in path.parts:
                expected.add(f"{dest}/{path.relative_to(ROOT / src).as_posix()}")
    assert "rematd/server/static/index.html" in expected
    assert expected <= names, sorted(expected - names)
