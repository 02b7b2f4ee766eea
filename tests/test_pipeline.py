"""Pipeline parallel (``torch.distributed.pipelining``) on CPU ranks (gloo): per-stage plans, bitwise training,
the agreement inside a stage's group, and the memory model under the schedule.

Each test runs a worker of ``tests.workers`` on 2 or 4 processes; the exactness workers train the same split
model with a plain schedule and with a schedule rematd is attached to, side by side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from bench.launch import run_launcher
from rematd import client
from rematd.client.parallel.pipeline import alive_at_peak

from .distributed import run_ranks

TWO_STAGES = [
    {"schedule": "gpipe", "split": "titan", "counts": [3, 2], "pinned": True, "steps": 4},
    {"schedule": "1f1b", "split": "hand", "counts": [2, 3], "pinned": True, "steps": 4},
    {"schedule": "interleaved", "split": "titan", "counts": [2, 1, 2, 1], "pinned": True, "steps": 4},
]


def check_exact(result: dict[str, Any]) -> None:
    case = result["case"]
    assert result["errors"] == 0 and result["step_count"] == len(result["steps"]), result
    for k, step in enumerate(result["steps"]):
        where = f"{case['schedule']} rank {result['rank']} step {k}"
        assert step["loss_equal"] and step["grads_equal"] and step["params_equal"], (where, step)
        for mode, rerun in zip(step["modes"], step["rerun"], strict=True):
            assert (rerun > 0) == (mode != "STORE"), (where, step)
        # Nothing rematd does adds a gather or a reduce-scatter, whatever recomputes.
        for kind in ("all_gather", "reduce_scatter"):
            assert step["rematd_comms"].get(kind, 0) == step["plain_comms"].get(kind, 0), (where, kind, step)


def test_pipeline_stages_train_bitwise_under_each_schedule_with_per_stage_plans_that_switch(tmp_path: Path) -> None:
    ranks = run_ranks("pipeline_exact", tmp_path, world=2, config=TWO_STAGES, timeout=300)
    for case, (first, second) in zip(TWO_STAGES, zip(*ranks, strict=True), strict=True):
        for result in (first, second):
            assert result["case"] == case
            check_exact(result)
            # The pins differ per stage and change every step after the profiling one.
            modes = [tuple(s["modes"]) for s in result["steps"]]
            assert all(m != modes[0] for m in modes[1:]) or len(set(modes[1:])) > 1, modes
        # Only the last stage computes the loss: one per microbatch.
        assert all(s["losses"] == 0 for s in first["steps"]) and all(s["losses"] == 4 for s in second["steps"])
        assert first["agreement"] is None and second["agreement"] is None, "stages never agree with each other"
        if case["schedule"] == "gpipe":  # every microbatch's forward before the first backward
            assert first["in_flight"] == [4] * 3 and second["in_flight"] == [4] * 2
        elif case["schedule"] == "1f1b":  # min(microbatches, stages - stage_index)
            assert first["in_flight"] == [2] * 2 and second["in_flight"] == [1] * 3
        else:  # two virtual stages a rank; blocks found in each stage module, named by stage
            assert first["stages"] == [0, 2] and second["stages"] == [1, 3]
            assert first["blocks"] == ["stage0.layers.0", "stage0.layers.1", "stage2.layers.3", "stage2.layers.4"]
            assert second["blocks"] == ["stage1.layers.2", "stage3.layers.5"]
            assert first["in_flight"][0] > first["in_flight"][-1] >= second["in_flight"][-1] == 1


def test_pipeline_with_tensor_and_fsdp2_inside_stages_agrees_only_inside_each_stage(tmp_path: Path) -> None:
    cases = [
        # The two tensor-parallel ranks of a stage plan differently (one budget fits nothing): they must agree.
        {"schedule": "1f1b", "counts": [3, 2], "inner": "tp", "budgets": [1, 10**12], "steps": 4},
        {"schedule": "gpipe", "counts": [3, 2], "inner": "fsdp", "pinned": True, "steps": 4},
    ]
    ranks = run_ranks("pipeline_exact", tmp_path, world=4, config=cases, timeout=400)
    tp, fsdp = ([r[i] for r in ranks] for i in range(2))
    for result in (*tp, *fsdp):
        check_exact(result)
        assert result["agreement"] is not None and "device mesh in (2)" in result["agreement"], result["agreement"]
    # Mesh (pp, in): ranks 0, 1 run stage 0, ranks 2, 3 stage 1.
    for k in range(len(tp[0]["steps"])):
        for a, b in ((0, 1), (2, 3)):
            assert tp[a]["steps"][k]["modes"] == tp[b]["steps"][k]["modes"], f"step {k}: a stage's ranks differ"
    last = [r["steps"][-1] for r in tp]
    assert last[1]["own"] != last[1]["modes"] and tp[1]["adopted"] > 0, "the rank with room took the leaner plan"
    assert last[0]["modes"] != last[2]["modes"], "the stages plan apart"
    # Recomputing a tensor-parallel block replays its all-reduce; the agreement is one more collective a step.
    for r in tp:
        assert all(s["rematd_comms"].get("agreement", 0) <= 2 for s in r["steps"]), r["steps"]
    for r in fsdp:
        assert all(s["plain_comms"].get("all_gather", 0) > 0 for s in r["steps"])


def test_each_stage_plans_for_its_microbatches_in_flight_under_one_budget(tmp_path: Path) -> None:
    cases = [{"steps": 8}, {"steps": 8, "schedule": "interleaved", "counts": [2, 2, 2, 2]}]
    ranks = run_ranks("pipeline_memory", tmp_path, world=2, config=cases, timeout=400)
    (first, last), (first_i, last_i) = zip(*ranks, strict=True)
    assert first["in_flight"] == [2] * 4 and last["in_flight"] == [1] * 4
    # Two virtual stages a rank: stages 0 and 2 hold 3 and 2 microbatches, stages 1 and 3 hold 2 and 1.
    assert first_i["in_flight"] == [3, 3, 2, 2] and last_i["in_flight"] == [2, 2, 1, 1]
    for a, b in ((first, last), (first_i, last_i)):
        budget = a["budget"]
        assert budget == b["budget"]
        # The budget: the first rank must recompute to fit it, the last need not.
        assert a["static_peaks"][0] > budget >= b["static_peaks"][0]
        for stage in (a, b):
            assert stage["errors"] == 0
            planned = [p for p in stage["planned"] if p["own"]]
            assert planned, stage["planned"]
            for p in planned:
                assert p["peak"] <= budget, p
                assert abs(p["predicted"] - p["peak"]) <= 0.1 * p["peak"], p
            # No stage recomputes more blocks than the fewest that a static "first k recomputed" fits with.
            fewest = next(k for k, peak in enumerate(stage["static_peaks"]) if peak <= budget)
            assert sum(m != "STORE" for m in planned[-1]["modes"]) <= fewest, (planned[-1], stage["static_peaks"])
        assert all(m == "STORE" for m in b["planned"][-1]["modes"])
        assert any(m != "STORE" for m in a["planned"][-1]["modes"])
    # Measured peaks a little under the model's: the correction learns below 1.
    assert any(p["correction"] < 1 for p in first["planned"] + first_i["planned"])


def test_a_stage_module_attached_without_its_schedule_is_planned_for_its_microbatches(tmp_path: Path) -> None:
    # rematd attached to each rank's stage module, h.pipeline never set: the schedule running the module is found
    # at the first step. 20 planned steps: the loosening has had its time.
    cases = [{"steps": 20, "attach": "module"}]
    (first,), (last,) = run_ranks("pipeline_memory", tmp_path, world=2, config=cases, timeout=400)
    assert first["found_schedule"] and last["found_schedule"]
    assert first["in_flight"] == [2] * 4 and last["in_flight"] == [1] * 4
    budget = first["budget"]
    for stage in (first, last):
        assert stage["errors"] == 0
        planned = [p for p in stage["planned"] if p["own"]]
        for p in planned:
            assert p["peak"] <= budget, p
            assert abs(p["predicted"] - p["peak"]) <= 0.1 * p["peak"], p
        fewest = next(k for k, peak in enumerate(stage["static_peaks"]) if peak <= budget)
        assert sum(m != "STORE" for m in planned[-1]["modes"]) <= fewest, (planned[-1], stage["static_peaks"])


def test_a_stage_module_whose_rank_runs_other_stages_too_is_refused_at_its_first_step(tmp_path: Path) -> None:
    # One rank, two stages of an interleaved schedule, rematd attached to the first stage's module only.
    cases = [{"schedule": "interleaved", "counts": [2, 2], "attach": "module", "refused": True}]
    ((said,),) = run_ranks("pipeline_memory", tmp_path, world=1, config=cases, timeout=200)
    assert said["said"].startswith("UnsupportedModel: pipeline: the schedule runs 2 stage(s)"), said
    assert "h.pipeline" in said["said"] and "client.attach(schedule)" in said["said"], said


def test_the_agreement_costs_the_same_at_every_world_size(tmp_path: Path) -> None:
    out = tmp_path / "agreement.json"
    stdout = run_launcher("bench.agreement", ["--ranks", "2,4", "--blocks", "24", "--steps", "3", "--out", str(out)])
    assert "| 2 |" in stdout and "| 4 |" in stdout
    runs = json.loads(out.read_text())["ranks"]
    seen = set()
    for world, ranks in runs.items():
        assert len(ranks) == int(world)
        for r in ranks:
            assert all(s["ok"] for s in r["steps"]), r
            # One all-reduce a step of a 32-bit integer per block and one for the plan's version; the first
            # step adds one of two integers.
            each = 4 * (24 + 1)
            assert [(s["collectives"], s["bytes"]) for s in r["steps"]] == [(2, 8 + each), (1, each), (1, each)]
            seen.add(json.dumps([(s["collectives"], s["bytes"]) for s in r["steps"]]))
    assert len(seen) == 1


def test_the_schedules_in_flight_are_read_from_their_own_order() -> None:
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    f, b = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    # 1F1B, stage 0 of 3, 5 microbatches: 3 forwards, then one backward for each forward.
    order = [_Action(0, f, i) for i in range(3)] + [
        a for i in range(2) for a in (_Action(0, b, i), _Action(0, f, 3 + i))
    ]
    assert alive_at_peak([*order, None, _Action(0, b, 3), _Action(0, b, 4)], [0]) == {0: 3}
    # Two virtual stages on a rank: counted apart, at the first moment the most are alive.
    order = [_Action(0, f, 0), _Action(0, f, 1), _Action(2, f, 0), _Action(2, b, 0), _Action(0, f, 2)]
    assert alive_at_peak(order, [0, 2]) == {0: 2, 2: 1}
    with pytest.raises(ValueError, match="ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B"):
        alive_at_peak([_Action(0, f, 0), _Action(0, _ComputationType.BACKWARD_INPUT, 0)], [0])


def test_a_pipeline_is_attached_through_its_schedule_and_bad_settings_are_refused() -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from bench.pipeline_models import llama, loss_fn, titan_stage

    from .distributed import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        module = titan_stage(llama(2), 0, [2])
        stage = PipelineStage(module, 0, 1, torch.device("cpu"))
        with pytest.raises(ValueError, match="pipeline: the schedule has no loss_fn"):
            client.attach(ScheduleGPipe(stage, 2))
        h = client.attach(module)
        other = titan_stage(llama(2), 0, [2])
        with pytest.raises(ValueError, match=r"pipeline: the schedule runs 1 stage\(s\).*client.attach\(schedule\)"):
            h.pipeline = ScheduleGPipe(PipelineStage(other, 0, 1, torch.device("cpu")), 2, loss_fn=loss_fn)
        schedule = ScheduleGPipe(stage, 2, loss_fn=loss_fn)
        h.pipeline = schedule
        assert h.pipeline is schedule and h.blocks == ["layers.0", "layers.1"]
        with pytest.raises(ValueError, match="pipeline: this handle follows a schedule already"):
            h.pipeline = schedule
        ids = torch.randint(0, 64, (4, 8))
        schedule.step(ids, target=ids, losses=[])
        h.step()
        assert h.step_count == 1 and h.last_shape.batch == 2, "a step is the schedule's, its shape a microbatch's"
        h.close()
        assert "step" not in schedule.__dict__, "close() gives the schedule its own step back"
        with pytest.raises(TypeError, match=r"pipeline must be a torch\.distributed\.pipelining schedule"):
            client.attach(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))).pipeline = "1f1b"
    finally:
        dist.destroy_process_group()


def test_deepspeed_pipeline_module_is_refused_naming_torch_pipelining() -> None:
    class PipelineModule(nn.Module):  # DeepSpeed's class, by name: deepspeed is refused before it is imported
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    with pytest.raises(client.UnsupportedModel, match=r"torch\.distributed\.pipelining"):
        client.attach(PipelineModule())


def test_the_pipeline_benchmark_runs_and_plans_each_stage_apart(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    stdout = run_launcher("bench.pipeline", ["--quick", "--out", str(out)])
    assert "| rematd |" in stdout and "| static |" in stdout
    first, last = json.loads(out.read_text())["ranks"]
    assert first["in_flight"][0] == 2 and last["in_flight"][0] == 1
    for stage in (first, last):
        assert stage["peaks"]["rematd"] <= stage["budget"] and stage["peaks"]["static"] <= stage["budget"], stage
        assert abs(stage["predicted"] - stage["peaks"]["rematd"]) <= 0.1 * stage["peaks"]["rematd"], stage
    # The last stage holds one microbatch: it stores what the static plan recomputes on every stage.
    recomputed = {(stage["rank"], c): stage["plans"][c].count("R") for stage in (first, last) for c in stage["plans"]}
    assert recomputed[1, "rematd"] < recomputed[1, "static"] <= recomputed[0, "rematd"], recomputed
