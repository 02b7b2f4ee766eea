"""What every worker does at its start and end: join the process group, and leave it writing its result."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def start(backend: str = "gloo") -> int:
    """Join the process group (one thread per rank: the ranks share the machine's cores); this rank."""
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    return dist.get_rank()


def settings() -> Any:
    return json.loads(os.environ["REMATD_CONFIG"])


def run_cases(run_case: Callable[[Any, int], Any]) -> None:
    """Join the group, run each case of ``REMATD_CONFIG`` (a list) in turn, and leave writing their results."""
    rank = start()
    finish([run_case(case, rank) for case in settings()])


def finish(result: Any, *, exit_now: bool = False) -> None:
    """Wait for every rank, leave the group, and write ``result`` where the test reads it.

    With ``exit_now`` (DeepSpeed's workers) the process then ends without finalising the interpreter:
    DeepSpeed keeps its gloo groups, and their threads, alive past ``destroy_process_group``, and a thread
    still releasing a collective's tensors when Python finalises aborts the rank after its result is written.
    """
    dist.barrier()
    dist.destroy_process_group()
    with open(os.environ["REMATD_RESULT"], "w") as f:
        json.dump(result, f)
    if exit_now:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
