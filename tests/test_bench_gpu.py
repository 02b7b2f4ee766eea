"""bench/gpu.py's smoke run: tiny Hugging Face models on the CPU, every strategy, real steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import QUICK_MODELS, STRATEGIES, Context, ModelSpec, build, layers

ROOT = Path(__file__).resolve().parent.parent


def test_the_quick_run_measures_every_strategy_and_writes_its_tables(tmp_path: Path) -> None:
    out = tmp_path / "bench-gpu.json"
    subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=300,
        capture_output=True,
    )
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["quick"]
    (model,) = report["models"]
    statics = {s["strategy"]: s for s in model["static"]}
    assert list(statics) == [
        *("none", "hf-full", "every-2nd", "every-3rd", "titan-selective"),
        *("rematd-recompute", "rematd-offload", "rematd-offload-fresh"),
    ]
    assert all(s["step_ms"] > 0 for s in model["static"])
    assert statics["hf-full"]["thread_ms"] is None and statics["rematd-recompute"]["thread_ms"] > 0
    assert statics["rematd-offload"]["modes"] == statics["rematd-offload-fresh"]["modes"] == "OOOO"
    assert [r["budget"] for r in model["rows"]] == ["30%", "90%"]
    for row in model["rows"]:
        assert len(row["modes"]) == 4 and "O" not in row["modes"] and "C" not in row["modes"], "offload is opt-in"
        assert row["predicted_peak_mib"] > 0 and row["predicted_x"] >= 1
        assert row["over"] == 0, f"no measured step over rematd's budget: {row}"
        assert row["thread_ms"] > 0, "rematd's time on the training thread, per step"
    tight, loose = model["rows"]
    assert tight["modes"].count(".") <= loose["modes"].count("."), "a tighter budget stores no more blocks"
    runs = {r["strategy"]: r for r in report["adaptive"]["runs"]}
    assert set(runs) == {"none", "hf-full", "every-2nd", "rematd"}
    assert all(r["tokens_per_s"] > 0 and r["ooms"] == 0 for r in runs.values())
    table = out.with_suffix(".md").read_text()
    assert "| budget |" in table and "best static that fits" in table and "## Adaptive" in table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's peaks")
def test_on_cuda_a_run_reads_the_allocator_and_rematd_keeps_to_its_budget() -> None:
    from bench.gpu import Job, ModelSpec, run_job

    # Blocks that hold most of what a step adds (the quick models' logits and allocator rounding outweigh
    # their blocks, so no plan could fit a budget between storing and recomputing them).
    spec = ModelSpec(name="gpt2-small-blocks", kind="gpt2", n_layer=4, d_model=256, n_head=4, vocab=256, batch=4,
                     seq=256, max_seq=256)  # fmt: skip
    device = torch.device("cuda")
    none = run_job(Job(model=spec, strategy="none", steps=3, warmup=2), device)
    assert none["max_peak"] > none["static_bytes"] > 0
    budget = none["static_bytes"] + 6 * (none["max_peak"] - none["static_bytes"]) // 10
    ours = run_job(Job(model=spec, strategy="rematd", steps=3, warmup=6, budget_bytes=budget, margin=0.05), device)
    assert ours["steps_over_budget"] == 0 and ours["predicted_peak"] > ours["static_bytes"]
    assert set(ours["modes"]) != {"."}, f"the budget is under storing every block: {ours['modes']}"


@pytest.mark.parametrize("spec", QUICK_MODELS, ids=lambda s: s.name)
def test_titan_selective_checkpoints_each_block_as_torchtitan_does_and_trains_alike(spec: ModelSpec) -> None:
    pytest.importorskip("torchtitan")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    def step(model: torch.nn.Module) -> tuple[int, list[torch.Tensor]]:
        saved = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[0] += t.numel() * t.element_size()
            return t

        ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return saved[0], [p.grad for p in model.parameters()]

    plain, wrapped = build(spec, torch.device("cpu")), build(spec, torch.device("cpu"))
    STRATEGIES["titan-selective"](Context(model=wrapped, opt=torch.optim.SGD(wrapped.parameters()), job=None))  # type: ignore[arg-type]
    assert all(isinstance(b, CheckpointWrapper) for b in layers(wrapped)), "every block wrapped, re-registered in place"
    kept, grads = step(wrapped)
    stored, reference = step(plain)
    assert kept < stored, "the policy recomputes some of what storing keeps"
    assert all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True)), "the same gradients"
