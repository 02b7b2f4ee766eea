"""Data parallel: two CPU ranks (gloo) under DDP, each streaming to one live service under one job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx

from .helpers import live_server

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    sys.path.insert(0, os.environ["REMATD_TESTS_ROOT"])
    from tests.helpers import tiny_model, batch
    from rematd import client
    from rematd.client.demo.tiny_gpt import lm_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_model(n_layer=4, d_model=16, dropout=0.1, seed=0)
    if rank == 0:
        h = client.attach(model, server=os.environ["REMATD_SERVER"], job="ddp-job", budget_bytes=1)
        ddp = DDP(model)
    else:  # the other order: attach to the wrapper, rematd attaches to the module inside
        ddp = DDP(model)
        h = client.attach(ddp, server=os.environ["REMATD_SERVER"], job="ddp-job", budget_bytes=10**12)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    h_opt = opt.register_step_post_hook(lambda *_: h.step())
    for step in range(8):
        torch.manual_seed(100 * rank + step)
        lm_loss(ddp, batch(16, seed=10 * rank + step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        h.flush(20.0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    result = {
        "rank": h.rank,
        "world_size": h.world_size,
        "blocks": h.blocks,
        "plan_blocks": list(h.plan.blocks),
        "in_sync": bool(torch.equal(gathered[0], gathered[1])),
        "steps": h.step_count,
    }
    h.close()
    dist.destroy_process_group()
    with open(os.environ["REMATD_RESULT"], "w") as f:
        json.dump(result, f)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_ddp_ranks_stream_under_one_job(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = str(Path(__file__).resolve().parent.parent)
    with live_server(tmp_path) as srv:
        port = free_port()
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "OMP_NUM_THREADS": "1",
                "REMATD_SERVER": srv.grpc,
                "REMATD_RESULT": str(tmp_path / f"rank{rank}.json"),
                "REMATD_TESTS_ROOT": root,
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        outputs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            outputs.append(out)
        for p, out in zip(procs, outputs, strict=True):
            assert p.returncode == 0, out[-3000:]
        results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        assert [r["rank"] for r in results] == [0, 1] and all(r["world_size"] == 2 for r in results)
        assert results[0]["blocks"] == results[1]["blocks"] == ["h.0", "h.1", "h.2", "h.3"]
        # Different plans on the two ranks (their budgets differ), and DDP keeps the replicas equal.
        # Nothing fits rank 0's byte: the leanest plan recomputes every block, but perhaps the last (its
        # stored activations are released before the others rematerialise).
        assert results[0]["plan_blocks"][:3] == [0, 1, 2] and results[1]["plan_blocks"] == []
        assert all(r["in_sync"] and r["steps"] == 8 for r in results)

        job = httpx.get(f"{srv.url}/api/v1/jobs/ddp-job", timeout=10).json()
        assert job["world_size"] == 2
        assert sorted(r["rank"] for r in job["ranks"]) == [0, 1]
        assert all(r["last_stats"] for r in job["ranks"]), job["ranks"]
