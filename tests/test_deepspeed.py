"""DeepSpeed ZeRO stages 1-3 on CPU ranks (gloo, ``DS_ACCELERATOR=cpu``), stock transformers models.

Each test runs a worker of ``tests.workers`` on 1 or 2 processes; the exactness worker trains the same model
with a plain engine and with an engine rematd is attached to, side by side, and reports per step what it saw.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from bench.collectives import differences

from .distributed import run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (scripts/setup.sh installs it: DS_BUILD_OPS=0, --no-build-isolation)",
)

DS = {"DS_ACCELERATOR": "cpu"}
TIMEOUT = 300.0  # the first DeepSpeed process on a machine builds its shared-memory op (a minute)


def check_exact(result: dict[str, Any], *, same_gathers: bool) -> None:
    case = result["case"]
    assert result["step_count"] == len(result["steps"]), case
    # ZeRO-3's gathers are collectives: its ranks run one plan. Stages 1 and 2 gather nothing in a forward.
    assert result["agreed"] == (case.get("stage", 3) == 3), case
    for k, step in enumerate(result["steps"]):
        where = f"{case} step {k} pinned {step['pinned']}"
        assert step["loss_equal"] and step["params_equal"], (where, step)
        expected = step["pinned"] or ["RECOMPUTE"] * len(result["blocks"])  # profiling recomputes every block
        assert step["modes"] == expected, where
        for mode, rerun in zip(expected, step["rerun"], strict=True):
            assert (rerun > 0) == (mode != "STORE"), (where, step["rerun"])
        kinds = ("all_gather", "reduce_scatter", "all_reduce") if same_gathers else ("reduce_scatter", "all_reduce")
        assert not differences(step["plain_comms"], step["rematd_comms"], kinds), (where, step)


def test_zero3_trains_bitwise_as_plain_zero3_and_gathers_no_more_when_blocks_recompute(tmp_path: Path) -> None:
    # Parameters released after every use: each use is one all-gather, so equal counts mean no second gather
    # for a recomputed block's backward (it uses what its recomputation gathered).
    cases = [
        {"model": "gpt2", "stage": 3, "order": "before"},
        {"model": "llama", "stage": 3, "order": "after", "accumulation": 2},
    ]
    for rank_results in run_ranks("deepspeed_exact", tmp_path, world=2, config=cases, timeout=TIMEOUT, env=DS):
        for result in rank_results:
            check_exact(result, same_gathers=True)
            recomputing = [s for s in result["steps"] if "RECOMPUTE" in s["modes"]]
            assert recomputing and all(s["plain_comms"]["all_gather"] > 0 for s in recomputing)


def test_zero_stages_1_and_2_and_bf16_train_bitwise_as_without_rematd(tmp_path: Path) -> None:
    cases = [
        {"model": "llama", "stage": 1, "order": "after"},
        {"model": "gpt2", "stage": 2, "order": "before", "accumulation": 2},
        {"model": "gpt2", "stage": 3, "order": "before", "bf16": True, "steps": 4},
    ]
    for rank_results in run_ranks("deepspeed_exact", tmp_path, world=2, config=cases, timeout=TIMEOUT, env=DS):
        for result in rank_results:
            check_exact(result, same_gathers=True)


def extra_steps(result: dict[str, Any]) -> list[int]:
    """The steps (after the first) at which rematd's engine all-gathered more than the plain one."""
    return [
        k
        for k, s in enumerate(result["steps"])
        if k > 0 and s["rematd_comms"].get("all_gather", 0) > s["plain_comms"].get("all_gather", 0)
    ]


def test_a_switch_costs_zero3_at_most_one_step_of_extra_gathers(tmp_path: Path) -> None:
    # ZeRO-3 as by default (prefetch, parameters kept while reused): plain gathers once a step once traced.
    # After the profiling step (every block recomputed), pins held three steps each: selective (the same fetch
    # order), storing (a switch to fewer gathers), a mix (a switch to more).
    cases = [{"model": "gpt2", "order": order, "live": True, "hold": True} for order in ("before", "after")]
    for rank_results in run_ranks("deepspeed_exact", tmp_path, world=2, config=cases, timeout=TIMEOUT, env=DS):
        for result in rank_results:
            check_exact(result, same_gathers=False)
            assert result["restarts"] == 2, result["restarts"]
            # Each switching step records ZeRO-3's new fetch order; the next one prefetches along it.
            assert extra_steps(result) == [4, 7], [s["rematd_comms"] for s in result["steps"]]


def test_attach_refuses_deepspeed_set_ups_it_cannot_checkpoint_saying_what_to_change(tmp_path: Path) -> None:
    (said,) = run_ranks("deepspeed_refusals", tmp_path, world=1, config="refusals", timeout=TIMEOUT, env=DS)
    assert (
        said["own_checkpointing"].startswith("UnsupportedModel")
        and "partition_activations" in said["own_checkpointing"]
    )
    assert 'Remove the "activation_checkpointing" section' in said["own_checkpointing"]
    assert "deepspeed.checkpointing.configure()" in said["configured"]
    assert "PipelineModule" in said["pipeline"] and "plain nn.Module" in said["pipeline"]
    assert "torch.distributed.pipelining" in said["pipeline"]
    assert said["not_an_engine"].startswith("TypeError") and "SGD" in said["not_an_engine"]


def test_zero3_partitions_and_gathered_parameters_are_static_memory_in_the_plan(tmp_path: Path) -> None:
    (mem,) = run_ranks("deepspeed_refusals", tmp_path, world=1, config="memory", timeout=TIMEOUT, env=DS)
    assert mem["step_count"] == 2, "engine.step() did not end the handle's steps"
    assert mem["engine_step_restored"] and mem["steps_after_close"] == 0
    # One rank holds everything: parameters, gradients and fp32 master weights (4 bytes each), Adam's 2 moments.
    assert mem["shard_bytes"] >= 5 * mem["full_param_bytes"]
    # A recomputed block held through its backward and the next one prefetched: two blocks' parameters.
    assert mem["gathered_at_peak"] >= 2 * mem["largest_block_bytes"]
    assert mem["static"] == mem["shard_bytes"] + mem["gathered_at_peak"]
