"""rematd's mode on torchtitan's command line, parsed without training: what ``--help`` shows and what is
refused at start. Writes one JSON object to ``REMATD_RESULT``: each check's outcome (what it printed, or the
error's type and words).

Runs in a process of its own (torchtitan changes torch's state when imported), with only the import stand-in.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable
from typing import Any

from bench.torchtitan_cpu import stub_triton_kernels

stub_triton_kernels()

import torch  # noqa: E402
from torchtitan.tools import utils as titan_utils  # noqa: E402

from rematd.integrations import torchtitan as integration  # noqa: E402

DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel"]


def outcome(fn: Callable[[], Any]) -> dict[str, str]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            result = fn()
    except SystemExit as done:
        return {"exit": str(done.code), "out": out.getvalue()}
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"ok": type(result).__name__, "out": out.getvalue()}


def parse(*args: str) -> Any:
    return integration.RematdConfigManager().parse_args([*DEBUG, *args])


def cuda_graphs() -> Any:
    """What a machine with an NVIDIA GPU would see: torchtitan captures CUDA graphs unless told not to."""
    available = torch.cuda.is_available
    device = titan_utils.device_type
    torch.cuda.is_available, titan_utils.device_type = (lambda: True), "cuda"
    try:
        return parse("activation-checkpoint:rematd")
    finally:
        torch.cuda.is_available, titan_utils.device_type = available, device


def outside_trainer() -> Any:
    policy = integration.RematdCheckpointing.Config().build(dump_folder="")
    return policy.apply(torch.nn.Module())


def main() -> None:
    checks: dict[str, Callable[[], Any]] = {
        "help": lambda: parse("--help"),
        "rematd_help": lambda: parse("activation-checkpoint:rematd", "--help"),
        "parsed": lambda: print(json.dumps(parse(*PARSED).activation_checkpoint.to_dict())),
        "selective_default": lambda: print(type(parse().activation_checkpoint).__qualname__),
        "compile": lambda: parse("--compile.enable", "activation-checkpoint:rematd"),
        "compile_loss_only": lambda: parse("--compile.enable", "--compile.components", "loss", *REMATD_COMPILE),
        "cuda_graphs": cuda_graphs,
        "cuda_graphs_off": lambda: parse("--training.disable-cuda-graphs", "activation-checkpoint:rematd"),
        "margin": lambda: parse("activation-checkpoint:rematd", "--activation-checkpoint.margin", "1.5"),
        "modes": lambda: parse("activation-checkpoint:rematd", "--activation-checkpoint.modes", "store,fast"),
        "compress_off": lambda: parse("activation-checkpoint:rematd", "--activation-checkpoint.compress", "int8"),
        "offload_off": lambda: parse("activation-checkpoint:rematd", "--activation-checkpoint.offload-prefetch", "2"),
        "offload_prefetch": lambda: parse(
            "activation-checkpoint:rematd",
            "--activation-checkpoint.modes",
            "store,offload",
            "--activation-checkpoint.offload-prefetch",
            "-1",
        ),
        "pin_compress": lambda: parse("activation-checkpoint:rematd", "--activation-checkpoint.pin", "compress"),
        "job": lambda: parse("activation-checkpoint:rematd", "--activation-checkpoint.job", "no spaces"),
        "server": lambda: parse("activation-checkpoint:rematd", "--activation-checkpoint.server", "nowhere"),
        "rng": lambda: parse("activation-checkpoint:rematd", "--activation-checkpoint.no-preserve-rng-state"),
        "rng_selective": lambda: parse(
            "activation-checkpoint:selective", "--activation-checkpoint.no-preserve-rng-state"
        ),
        "pipeline": lambda: parse(*PIPELINE, "activation-checkpoint:rematd"),
        "version": lambda: integration.check_version("0.2.0"),
        "outside_trainer": outside_trainer,
    }
    result = {name: outcome(check) for name, check in checks.items()}
    with open(os.environ["REMATD_RESULT"], "w") as f:
        json.dump(result, f)


PARSED = [
    "activation-checkpoint:rematd",
    "--activation-checkpoint.budget-bytes",
    "80000000",
    "--activation-checkpoint.margin",
    "0.05",
    "--activation-checkpoint.modes",
    "store,recompute,compress",
    "--activation-checkpoint.pin",
    "recompute,store",
    "--activation-checkpoint.compress",
    "fp8",
    "--activation-checkpoint.job",
    "titan-1",
]
PIPELINE = ["--parallelism.pipeline-parallel-degree", "2", "--training.disable-cuda-graphs"]
REMATD_COMPILE = ["activation-checkpoint:rematd", "--activation-checkpoint.compile"]


if __name__ == "__main__":
    main()
