"""Sharded training: FSDP2 (``fully_shard``) and tensor parallel, on CPU ranks (gloo), stock transformers models.

Each test runs a worker of ``tests.workers`` on 1, 2 or 4 processes; the worker trains the same model with
and without rematd side by side and reports per step what it saw.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from bench.collectives import differences
from rematd import client
from rematd.client.parallel.fsdp import refuse_fsdp1

from .distributed import run_ranks
from .helpers import live_server
from .workers.switch_matrix import EXACT

SHARDING = [
    pytest.param([{"model": "llama", "order": "before"}, {"model": "gpt2", "order": "after"}], id="both-orders"),
    pytest.param(
        [{"model": "llama", "order": "after", "reshard": False}, {"model": "gpt2", "order": "before", "reshard": 1}],
        id="reshard-false-and-int",
    ),
    pytest.param(
        [
            {"model": "gpt2", "order": "before", "mixed_precision": True},
            {"model": "llama", "order": "after", "autocast": True},
        ],
        id="bf16-params-and-autocast",
    ),
    pytest.param(
        [
            {"model": "llama", "order": "before", "compile": "aot_eager"},
            {"model": "gpt2", "order": "after", "compile": "aot_eager"},
        ],
        id="compiled-both-orders",
    ),
]


def check_exact(result: dict[str, Any]) -> None:
    case = result["case"]
    assert result["step_count"] == len(result["steps"]), case
    for k, step in enumerate(result["steps"]):
        where = f"{case} step {k} pinned {step['pinned']}"
        if case.get("compile"):
            # Compiled graphs order some sums their own way: equal to 1e-5, as without sharding.
            assert step["max_diff"] <= 1e-5, (where, step)
        else:
            assert step["loss_equal"] and step["grads_equal"] and step["params_equal"], (where, step)
        expected = step["pinned"] or ["RECOMPUTE"] * len(result["blocks"])  # profiling recomputes every block
        assert step["modes"] == expected, where
        for mode, rerun in zip(expected, step["rerun"], strict=True):
            assert (rerun > 0) == (mode != "STORE"), (where, step["rerun"])
        if not case.get("compile"):
            # No all-gather again for a recomputation, and no extra reduce-scatter.
            assert not differences(step["plain_comms"], step["rematd_comms"], ("all_gather", "reduce_scatter")), where
            assert step["plain_comms"].get("all_gather", 0) > 0 and step["plain_comms"].get("reduce_scatter", 0) > 0
    if case.get("compile"):
        assert result["graphs"] > 0, "the compiled case compiled nothing"


@pytest.mark.parametrize("cases", SHARDING)
def test_fsdp2_trains_bitwise_as_plain_fsdp2_with_no_extra_collectives(
    tmp_path: Path, cases: list[dict[str, Any]]
) -> None:
    for rank_results in run_ranks("fsdp_exact", tmp_path, world=2, config=cases):
        assert [r["case"] for r in rank_results] == cases
        for result in rank_results:
            check_exact(result)


def test_tensor_parallel_and_fsdp2_on_a_2d_mesh_train_bitwise_as_without_rematd(tmp_path: Path) -> None:
    results = run_ranks("fsdp_tp", tmp_path, world=4, config={"pinned": True}, timeout=300)
    for rank, result in enumerate(results):
        for k, step in enumerate(result["steps"]):
            where = f"rank {rank} step {k}"
            assert step["loss_equal"] and step["grads_equal"] and step["params_equal"], (where, step)
            plain, ours = step["plain_comms"], step["rematd_comms"]
            for kind in ("all_gather", "reduce_scatter"):
                assert ours.get(kind) == plain.get(kind), (where, kind, step)
            # Selective keeps what the block's collectives produced; recomputing a block replays its all-reduces,
            # and so does torchtitan's policy (it keeps a reduce-scatter's or an all-to-all's, not an all-reduce's).
            # A part recomputed alone stops before its own closing all-reduce: nothing saved for backward needs it.
            if {"RECOMPUTE", "TITAN"} & set(step["modes"]):
                assert ours.get("all_reduce", 0) > plain.get("all_reduce", 0), (where, step)
            else:
                assert ours.get("all_reduce") == plain.get("all_reduce"), (where, step)
    for k in range(len(results[0]["steps"])):
        assert len({tuple(r["steps"][k]["modes"]) for r in results}) == 1, f"step {k}: the ranks ran different modes"


def test_every_switch_under_tensor_parallel_and_fsdp2_trains_bitwise(tmp_path: Path) -> None:
    """The switch matrix on a 2 x 2 mesh: each block through every ordered pair of the exact modes."""
    results = run_ranks("fsdp_tp", tmp_path, world=4, config={"circuit": True}, timeout=400)
    switches: set[tuple[str, str]] = set()
    for rank, result in enumerate(results):
        steps = result["steps"]
        for k, step in enumerate(steps):
            assert step["loss_equal"] and step["grads_equal"] and step["params_equal"], (f"rank {rank} step {k}", step)
        for before, after in itertools.pairwise(steps[1:]):
            switches |= {(a, b) for a, b in zip(before["modes"], after["modes"], strict=True) if a != b}
    exact = {m.name for m in EXACT}
    assert switches == {(a, b) for a in exact for b in exact if a != b}, sorted(switches)
    for k in range(len(results[0]["steps"])):
        assert len({tuple(r["steps"][k]["modes"]) for r in results}) == 1, f"step {k}: the ranks ran different modes"


def test_ranks_that_plan_differently_run_the_leanest_plan_together(tmp_path: Path) -> None:
    # Rank 0's budget fits nothing; the others' fits everything: their own plans disagree at every step.
    budgets = [1, 10**12, 10**12, 10**12]
    results = run_ranks("fsdp_tp", tmp_path, world=4, config={"budgets": budgets, "steps": 5}, timeout=300)
    for k in range(1, 5):
        modes = {tuple(r["steps"][k]["modes"]) for r in results}
        assert len(modes) == 1, f"step {k}: the ranks ran {modes}"
        assert results[0]["steps"][k]["modes"] == results[0]["steps"][k]["own"]
        assert results[1]["steps"][k]["own"] != results[1]["steps"][k]["modes"], "rank 1 should plan otherwise"
        # Where nothing fits, rank 0's plan is the leanest there is: every block but the last recomputes (the
        # last one's activations are the first backward frees).
        assert all(r["steps"][k]["recomputed"] >= len(r["steps"][k]["modes"]) - 1 for r in results)
    for rank, result in enumerate(results):
        assert all(s["loss_equal"] and s["grads_equal"] and s["params_equal"] for s in result["steps"]), rank
    assert results[0]["adopted"] == 0 and all(r["adopted"] >= 4 for r in results[1:])


def test_an_out_of_memory_error_on_one_rank_tightens_every_rank_at_its_next_step(tmp_path: Path) -> None:
    config = {"budgets": [10**12] * 4, "steps": 5, "oom_at": 3}
    results = run_ranks("fsdp_tp", tmp_path, world=4, config=config, timeout=300)
    before = [r["steps"][2] for r in results]
    after = [r["steps"][3] for r in results]
    assert all(s["recomputed"] == 0 for s in before), before
    assert len({tuple(s["modes"]) for s in after}) == 1
    assert after[0]["recomputed"] > 0, "the out-of-memory error on rank 1 did not tighten the plan"
    # Rank 1 made the tighter plan; the others took it without an OOM of their own.
    assert after[1]["modes"] == after[1]["own"] and after[0]["modes"] != after[0]["own"]


def test_fsdp_memory_is_in_the_plan_on_the_cpu_accounting_path(tmp_path: Path) -> None:
    results = run_ranks("fsdp_memory", tmp_path, world=2, config={})
    # The ranks run one plan and name it by one version, step by step.
    assert [[(s["version"], s["modes"]) for s in r["runs"]] for r in results].count(
        [(s["version"], s["modes"]) for s in results[0]["runs"]]
    ) == 2, [r["runs"] for r in results]
    for rank, r in enumerate(results):
        # FSDP's gathered weights are not activations: the sharded blocks profile as the unsharded ones.
        assert r["sharded_saved"] == r["plain_saved"], rank
        # The rank's shards (half the parameters, then their gradients and Adam's two moments) are static, and
        # so are the parameters gathered in backward (every moment of it holds some), not what grows with tokens.
        assert r["gathered"] > 0 and all(t[1] or t[2] for t in r["other_terms"]), r
        # The first plan counts what the profiling step left for the steps after it: Adam's moments, and the
        # gradients, which this loop frees with zero_grad() but torchtitan's keeps (set_to_none=False): which
        # one a loop does shows only at its next step, so the first plan counts them.
        assert r["hello_static"] == r["shard_bytes"] + r["full_param_bytes"] // 2 + r["gathered"]
        assert r["shard_bytes"] == 3 * r["full_param_bytes"] // 2
        assert r["static"] == r["shard_bytes"] + r["gathered"]
        # The first step after it shows they were freed: the planner is told what stayed.
        assert r["hello_static_after"] == r["static"], r
        assert r["store_peak"] > r["static"]
        settled = r["runs"][2:]
        assert any(m != "STORE" for m in settled[-1]["modes"]), "the cut budget did not make the planner checkpoint"
        for run in settled:
            assert run["peak"] <= r["budget"], (run, r["budget"])
            assert run["predicted"] >= r["static"]
            assert abs(run["predicted"] - run["peak"]) <= 0.1 * run["peak"], run


def test_a_budget_just_above_the_leanest_plan_is_never_crossed_under_fsdp2(tmp_path: Path) -> None:
    # hard_limit_bytes at the budget's room for activations: a step over the budget raises, in a plain loop.
    cases = [{"factor": 1.02}, {"factor": 1.08}]
    for rank, results in enumerate(run_ranks("fsdp_tight", tmp_path, world=2, config=cases)):
        for r in results:
            where = f"rank {rank} x{r['case']['factor']}"
            assert r["errors"] == 0 and not r["raised"], (where, r["raised"])
            over = [(k, s["peak"]) for k, s in enumerate(r["steps"]) if s["peak"] > r["budget"]]
            assert not over, (where, r["budget"], over)
            # From the first plan on (the profiling step runs none), none is predicted over the budget.
            assert all(s["predicted"] <= r["budget"] for s in r["steps"][1:]), (where, r["steps"])
            assert r["steps"][0]["modes"] == ["RECOMPUTE"] * 4, "the profiling step recomputes every block"


def test_ranks_on_different_service_workers_run_one_plan(tmp_path: Path) -> None:
    with live_server(tmp_path, args=("--workers", "2")) as srv:
        results = run_ranks("fsdp_served", tmp_path, world=2, config=[1, 10**12], env={"REMATD_SERVER": srv.grpc})
        job = httpx.get(f"{srv.url}/api/v1/jobs/fsdp-served", timeout=10).json()
    assert sorted(r["rank"] for r in job["ranks"]) == [0, 1] and job["world_size"] == 2
    for k in range(1, 6):
        assert results[0]["steps"][k]["modes"] == results[1]["steps"][k]["modes"], f"step {k}"
        # One plan, one name: each rank's service session numbers its own plans, the ranks show the newest.
        assert results[0]["steps"][k]["plan_version"] == results[1]["steps"][k]["plan_version"], f"step {k}"
    last = results[1]["steps"][-1]["modes"]
    assert last.count("RECOMPUTE") >= len(last) - 1, "rank 0's leaner plan was not run by rank 1"
    assert results[1]["adopted"] > 0 and results[0]["adopted"] == 0


def test_sharded_models_attach_refuses_say_what_to_change(tmp_path: Path) -> None:
    (said,) = run_ranks("fsdp_refusals", tmp_path, world=1, config={})
    for key in ("units_inside_blocks", "units_inside_blocks_after_attach"):
        assert "'model.layers.0'" in said[key] and "hold FSDP units of their own" in said[key], said[key]
        assert "fully_shard to the blocks themselves" in said[key]
    assert (
        "'transformer.h.0'" in said["blocks_outside_units"]
        and "fully_shard on each block" in said["blocks_outside_units"]
    )
    # h.optimizer follows an optimizer made after sharding; None stops following it.
    assert said["steps_followed"] == 2 and said["steps_unfollowed"] == 2


def test_fsdp1_is_refused_naming_fully_shard() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1 cannot be built on a CPU-only machine: an instance of its class, not initialised, stands in.
    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper._modules["_fsdp_wrapped_module"] = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(client.UnsupportedModel, match=r"FSDP1.*fully_shard"):
        refuse_fsdp1(wrapper)
    with pytest.raises(client.UnsupportedModel, match=r"FSDP1.*fully_shard"):
        client.attach(wrapper)


def test_the_handle_follows_an_optimizer_given_after_attach() -> None:
    from tests.helpers import tiny_model, train_step

    model = tiny_model(n_layer=2, d_model=16)
    h = client.attach(model)
    first = torch.optim.SGD(model.parameters(), lr=0.01)
    second = torch.optim.SGD(model.parameters(), lr=0.01)
    h.optimizer = first
    train_step(model, first, 8)
    assert h.step_count == 1 and h.optimizer is first
    h.optimizer = second  # the first one no longer ends a step
    train_step(model, first, 8)
    assert h.step_count == 1
    train_step(model, second, 8)
    assert h.step_count == 2
    with pytest.raises(TypeError, match="optimizer"):
        h.optimizer = "adam"  # type: ignore[assignment]
    h.close()
    train_step(model, second, 8)  # after close the hook is gone
    assert h.step_count == 2
