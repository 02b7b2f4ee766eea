"""rematd as torchtitan's ``activation-checkpoint:rematd``: its debug models trained by torchtitan's own trainer on
CPU ranks (gloo), through ``python -m rematd.integrations.torchtitan`` with torchtitan's own arguments.

The debug Llama on 1 rank, on 2 ranks with FSDP and on 2 ranks with tensor parallel, and the mixtures of experts
``qwen3_moe_debug`` (with 16 experts a block) and ``deepseek_v3_debugmodel`` on 2 ranks with expert parallel 2:
torchtitan without checkpointing is the reference; rematd with a pinned plan (recompute, selective and store by
turns) and rematd under its planner, at a budget between that plan's measured peak (leaner than none, looser than
full checkpointing) and every block stored, must give bitwise the same losses and parameters; the planned run's
measured peaks stay under the budget from its first planned step, whose prediction counts what the profiling step
left behind (gradients torchtitan keeps allocated, optimizer state), and the ranks run one plan. The stand-ins
torchtitan needs on the CPU are in ``bench/torchtitan_cpu.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

if sys.version_info < (3, 11):
    pytest.skip("torchtitan needs Python 3.11 or later", allow_module_level=True)

import torch

from bench.launch import run_launcher, run_ranks
from bench.torchtitan_cpu import DIGESTS, FLOAT_EXPERTS, QWEN3_EXPERTS, RECORD, make_assets

STEPS = 4
PIN = ["recompute", "selective", "store"] * 2
MIB = 2**20


class Model(NamedTuple):
    """A torchtitan model and the run the tests train it for."""

    args: tuple[str, ...]
    layers: int
    seq: int = 128
    steps: int = STEPS
    params: str = "float32"
    """Mixed precision's parameter dtype: torchtitan's default (bfloat16) is many times slower on CPUs without
    bfloat16 matmul instructions, so one case keeps it and the others train in float32."""
    env: tuple[tuple[str, str], ...] = ()
    """What the launcher is given besides (``bench/torchtitan_cpu.py``'s settings)."""

    def pin(self) -> list[str]:
        """Recompute, selective and store by turns, one mode per layer."""
        return [PIN[i % 3] for i in range(self.layers)]


LLAMA = Model(("--module", "llama3", "--config", "llama3_debugmodel"), 6)
# bfloat16 matmuls are ten times float32's on CPUs without its instructions: a shorter run.
LLAMA_BF16 = LLAMA._replace(params="bfloat16", seq=64, steps=3)
# The mixtures of experts: an attention and a mixture of experts a block (deepseek_v3's first block dense), the
# router sending tokens to other ranks' experts through all-to-all under expert parallel. Shorter runs: the
# profiling step, the first plan's, and one after it. qwen3's debug model with 16 experts a block, 4 chosen a
# token, instead of 64 and 8: its 1.2 GB of parameters (and twice that of optimizer state) made a step seconds
# of memory traffic on the CPU, and what is checked (the router, the all-to-all, the experts split between the
# ranks) does not depend on their number.
QWEN3_MOE = Model(
    ("--module", "qwen3", "--config", "qwen3_moe_debug", "--training.disable-cuda-graphs"), 8, 64, 3,
    env=((QWEN3_EXPERTS, "16,4"),),
)  # fmt: skip
DEEPSEEK_V3 = Model(
    ("--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--training.disable-cuda-graphs"), 6, 64, 3
)
EXPERT_PARALLEL = ("--parallelism.expert-parallel-degree", "2")
# Three runs of a mixture of experts take 1-3 minutes on a 2-core machine, past the default timeout when other
# tests share the cores.
LONG = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_assets(tmp_path_factory.mktemp("titan_assets"))


def train(
    tmp: Path,
    assets: tuple[Path, Path],
    *,
    ranks: int,
    module: str,
    checkpointing: list[str],
    parallelism: tuple[str, ...] = (),
    model: Model = LLAMA,
    steps: int | None = None,
) -> list[Any]:
    """Train ``model`` ``steps`` steps (default: the model's); what each rank recorded (losses, rematd's steps,
    parameters)."""
    record = tmp / f"record-{len(list(tmp.iterdir()))}"
    record.mkdir()
    tokenizer, data = assets
    titan_args = [
        *model.args,
        *("--hf-assets-path", str(tokenizer), "--dataloader.dataset-path", str(data)),
        *("--dump-folder", str(record / "out"), "--training.steps", str(steps or model.steps)),
        *("--training.seq-len", str(model.seq), "--training.local-batch-size", "2", "--debug.seed", "0"),
        *("--training.mixed-precision-param", model.params),
        # torch releases shard torchtitan's default spmd_types parameters only from a nightly on.
        *("--parallelism.spmd-backend", "partial_dtensor"),
        *parallelism,
    ]
    # The ranks started directly rather than by torchrun, whose agent adds seconds to each of the many launches
    # here; torchrun itself runs the documented commands (tests/test_examples.py) and the benchmarks.
    run_ranks(
        ranks,
        "bench.torchtitan_cpu",
        [module, *titan_args, *checkpointing],
        timeout=400,
        # Each rank's parameters as digests of its own parts' bytes: the runs compared are sharded alike, and the
        # whole model (qwen3's MoE 1.2 GB of it) would otherwise be gathered, written and read back for each rank.
        # The experts' matmuls in float32, as the rest: bfloat16's are slow on CPUs without its instructions.
        env={RECORD: str(record), DIGESTS: "1", FLOAT_EXPERTS: "1", "OMP_NUM_THREADS": "1", **dict(model.env)},
    )
    return [torch.load(record / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def assert_bitwise(reference: list[Any], run: list[Any], what: str) -> None:
    for rank, (ref, got) in enumerate(zip(reference, run, strict=True)):
        assert len(got["losses"]) == len(ref["losses"])
        for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
            assert torch.equal(a, b), f"{what}: rank {rank} step {step + 1} loss {b.item()} != {a.item()}"
        assert ref["params"].keys() == got["params"].keys()
        differ = [n for n, p in ref["params"].items() if p != got["params"][n]]
        assert not differ, f"{what}: rank {rank} parameters differ: {differ[:5]}"


@pytest.mark.parametrize(
    ("model", "ranks", "parallelism"),
    [
        (LLAMA_BF16, 1, ()),
        (LLAMA, 2, ()),
        (LLAMA, 2, ("--parallelism.tensor-parallel-degree", "2")),
        pytest.param(QWEN3_MOE, 2, EXPERT_PARALLEL, marks=LONG),
        pytest.param(DEEPSEEK_V3, 2, EXPERT_PARALLEL, marks=LONG),
    ],
    ids=[
        "1-rank",
        "2-ranks-fsdp",
        "2-ranks-tensor-parallel",
        "qwen3-moe-expert-parallel",
        "deepseek-v3-expert-parallel",
    ],
)
def test_rematd_mode_trains_as_torchtitan_and_holds_the_budget(
    tmp_path: Path, assets: tuple[Path, Path], model: Model, ranks: int, parallelism: tuple[str, ...]
) -> None:
    reference = train(
        tmp_path, assets, ranks=ranks, module="torchtitan.train", checkpointing=["activation-checkpoint:none"],
        parallelism=parallelism, model=model,
    )  # fmt: skip
    rematd = ["activation-checkpoint:rematd", "--activation-checkpoint.margin", "0.02"]
    pin, recomputing = model.pin(), ["recompute"] * model.layers

    pinned = train(
        tmp_path, assets, ranks=ranks, module="rematd.integrations.torchtitan",
        checkpointing=[*rematd, "--activation-checkpoint.pin", ",".join(pin)], parallelism=parallelism, model=model,
    )  # fmt: skip
    assert_bitwise(reference, pinned, "pinned plan")
    assert len(reference[0]["losses"]) == model.steps
    profiled, *later = pinned[0]["steps"]
    # The profiling step recomputes every block: no more memory than the leanest plan.
    assert [s[0]["modes"] for s in pinned[0]["steps"]] == [recomputing] + [pin] * (model.steps - 1)
    assert later[0][0]["static"] > profiled[0]["static"], "gradients and optimizer state persist from step 2 on"
    # What a later step would peak at with every block stored, as the planner prices it. Under expert parallel
    # each rank's experts take the tokens the router sends them: the figures differ by rank, the budget is
    # between them all.
    # Read at the last step: the planner runs on its own thread, and at a step's end it may not have taken in
    # that step yet (at the first step after profiling, the optimizer's state it created).
    storing = min(record["steps"][-1][0]["storing"] for record in pinned)
    mixed = max(s[0]["measured"] for record in pinned for s in record["steps"][1:])
    assert profiled[0]["measured"] - profiled[0]["static"] < mixed - later[0][0]["static"] < storing
    budget = (mixed + storing) // 2

    # Storing and recomputing whole blocks: the check below is of the static memory the first plan counts,
    # which an op policy's or a part's kept outputs, priced from the profiling step alone, would blur (their
    # first plans over-predict under FSDP: parts by up to 5%, selective once by 7.7% when the step times of a
    # loaded machine put it in the first plan; the finer modes run in torchtitan's trainer in the
    # tight-budget test below).
    block_modes = ["--activation-checkpoint.modes", "store,recompute"]
    planned = train(
        tmp_path, assets, ranks=ranks, module="rematd.integrations.torchtitan",
        checkpointing=[*rematd, *block_modes, "--activation-checkpoint.budget-bytes", str(budget)],
        parallelism=parallelism, model=model,
    )  # fmt: skip
    assert_bitwise(reference, planned, "planned")
    for rank, record in enumerate(planned):
        steps = [s[0] for s in record["steps"]]
        assert steps[0]["modes"] == recomputing, "the first step profiles, every block recomputed"
        # The first plan is made on each rank's planner thread and runs from the first step it has arrived on
        # every rank that agrees on plans; until then every block recomputes, as profiling did.
        planned_from = next((k for k, s in enumerate(steps) if s["modes"] != recomputing), len(steps))
        assert planned_from < len(steps), f"rank {rank}: no step ran a plan: {steps}"
        first = steps[planned_from]
        # Planned between the leanest and the loosest: neither what the profiling step ran nor every block stored.
        assert first["plan_version"] >= 1 and first["modes"] not in (recomputing, ["store"] * model.layers), first
        # The first plan counted what persists from the profiling step: measured within 2% of its prediction.
        assert abs(first["measured"] - first["predicted"]) <= 0.02 * first["measured"], first
        over = [(s["step"], s["measured"] / MIB) for s in steps if s["measured"] > budget]
        assert not over, f"rank {rank}: steps over the budget of {budget / MIB:.1f} MiB: {over}"
    # The ranks' parameters are sharded: they run one plan, step for step.
    ran = [[s[0]["modes"] for s in record["steps"]] for record in planned]
    assert all(modes == ran[0] for modes in ran), ran


def test_rematd_mode_holds_a_budget_just_above_the_leanest_plan(tmp_path: Path, assets: tuple[Path, Path]) -> None:
    lean = train(
        tmp_path, assets, ranks=1, module="rematd.integrations.torchtitan",
        checkpointing=["activation-checkpoint:rematd", "--activation-checkpoint.pin", ",".join(["recompute"] * 6)],
    )  # fmt: skip
    leanest = max(s[0]["measured"] for s in lean[0]["steps"][1:])
    factor = 1.02  # the tightest the first plans had crossed
    budget = int(factor * leanest)
    run = train(
        tmp_path, assets, ranks=1, module="rematd.integrations.torchtitan", steps=8,
        checkpointing=["activation-checkpoint:rematd", "--activation-checkpoint.budget-bytes", str(budget)],
    )  # fmt: skip
    steps = [s[0] for s in run[0]["steps"]]
    over = [(s["step"], s["measured"] / MIB) for s in steps if s["measured"] > budget]
    assert not over, f"x{factor}: steps over the budget of {budget / MIB:.2f} MiB: {over}"
    predicted_over = [(s["step"], s["predicted"] / MIB) for s in steps[1:] if s["predicted"] > budget]
    assert not predicted_over, f"x{factor}: plans predicted over the budget: {predicted_over}"


def test_command_line_shows_and_refuses(tmp_path: Path) -> None:
    """``--help``, the flags' values, and every refusal at start, each naming the flag to change."""
    result = tmp_path / "cli.json"
    run_launcher("tests.workers.torchtitan_cli", [], timeout=200, env={"COLUMNS": "200", "REMATD_RESULT": str(result)})
    out = json.loads(result.read_text())
    assert "activation-checkpoint:rematd" in out["help"]["out"] and out["help"]["exit"] == "0"
    rematd_help = out["rematd_help"]["out"]
    for flag in ("budget-bytes", "margin", "modes", "pin", "server", "job", "compress", "offload-prefetch", "compile"):
        assert f"--activation-checkpoint.{flag}" in rematd_help, flag
    assert "preserve-rng-state" not in rematd_help, "torchtitan's wrapper settings are no rematd flags"
    assert json.loads(out["parsed"]["out"].splitlines()[-1]) == {
        "budget_bytes": 80000000, "margin": 0.05, "modes": ["store", "recompute", "compress"],
        "pin": ["recompute", "store"], "server": None, "job": "titan-1", "compress": "fp8", "offload_prefetch": None,
        "compile": False,
        "preserve_rng_state": True, "determinism_check": "default", "debug": False,
    }  # fmt: skip
    assert out["selective_default"]["out"].splitlines()[-1] == "SelectiveAC.Config", "torchtitan's default is unchanged"
    assert "ok" in out["compile_loss_only"] and "ok" in out["cuda_graphs_off"]
    refused = {
        "compile": "--activation-checkpoint.compile",
        "cuda_graphs": "--training.disable-cuda-graphs",
        "margin": "--activation-checkpoint.margin",
        "modes": "--activation-checkpoint.modes",
        "compress_off": "--activation-checkpoint.compress",
        "offload_off": "--activation-checkpoint.offload-prefetch configures the offload mode",
        "offload_prefetch": "--activation-checkpoint.offload-prefetch: offload.prefetch_blocks must be",
        "pin_compress": "--activation-checkpoint.pin",
        "job": "--activation-checkpoint.job",
        "server": "--activation-checkpoint.server",
        "rng": "no-preserve-rng-state",
    }
    for check, words in refused.items():
        assert out[check].get("exit") == "2" and words in " ".join(out[check]["out"].split()), (check, out[check])
    assert "ok" in out["rng_selective"], "torchtitan's own modes keep their flags"
    # Pipeline stages are planned through the schedule: the flag is accepted.
    assert "ok" in out["pipeline"], out["pipeline"]
    assert out["version"] == {
        "error": "RuntimeError",
        "message": "rematd.integrations.torchtitan supports torchtitan 0.3.0; this is torchtitan 0.2.0: "
        "pip install torchtitan==0.3.0",
    }
    assert out["outside_trainer"]["error"] == "RuntimeError"
    assert "python -m rematd.integrations.torchtitan" in out["outside_trainer"]["message"]


@pytest.mark.parametrize("spec", ["16", "x,4", "4,8", "4,0"])
def test_the_launchers_expert_count_is_refused_unless_two_fitting_integers(spec: str) -> None:
    from bench.torchtitan_cpu import _qwen3_experts

    with pytest.raises(SystemExit, match=f"{QWEN3_EXPERTS}={spec!r}"):
        _qwen3_experts(spec)


def test_the_flags_become_attachs_arguments() -> None:
    """What rematd's flags hand ``attach`` (torchtitan itself not imported: the flags as parsed)."""
    from types import SimpleNamespace

    from rematd.client import OffloadConfig
    from rematd.integrations.torchtitan_parts import attach_options

    flags = dict(budget_bytes=2**30, margin=0.2, modes=["store", "offload"], server=None, job="j", compile=False)
    got = attach_options(SimpleNamespace(**flags, compress=None, offload_prefetch=3))  # type: ignore[arg-type]
    assert got["offload"] == OffloadConfig(prefetch_blocks=3) and got["modes"] == ["store", "offload"]
    assert (got["budget_bytes"], got["margin_ratio"], got["job"]) == (2**30, 0.2, "j")
    assert attach_options(SimpleNamespace(**flags, compress=None, offload_prefetch=None))["offload"] is None  # type: ignore[arg-type]
