"""One rank of the tensor-parallel test: FSDP2 over a 2 x 2 mesh (data x tensor), rematd attached in torchtitan's
order (parallelize, attach, shard), trained beside the same model without rematd.

``REMATD_CONFIG`` says what the ranks do: ``"pinned"`` pins every rank through store, selective, recompute and
a mix, then the finer modes; ``"circuit"`` pins the blocks through every switch between two exact modes (the
switch matrix's circuit); ``"budgets"`` gives each rank its own budget (so that their own planners disagree)
and lets rank 1 report an out-of-memory error at step 3. Written per step: this rank's modes and own plan,
bitwise equality with the run without rematd, and the collectives each issued.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from bench.collectives import counting
from rematd import client
from rematd.client import introspect
from rematd.planner import Mode
from tests.workers.fsdp_exact import VOCAB, all_equal, build, schedule
from tests.workers.rank import finish, settings, start
from tests.workers.switch_matrix import EXACT
from tests.workers.switch_matrix import pins as switch_pins

TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def parallel(model: nn.Module, mesh: Any) -> None:
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)


def shard(model: nn.Module, mesh: Any) -> None:
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def main() -> None:
    rank = start()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    config = settings()
    ref, model = build("llama"), build("llama")
    parallel(ref, mesh)
    shard(ref, mesh)
    parallel(model, mesh)
    budget = config["budgets"][rank] if "budgets" in config else None
    h = client.attach(model, budget_bytes=budget)  # torchtitan's order: parallelize, checkpoint, shard
    shard(model, mesh)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    h.optimizer = opt
    n = len(h.blocks)
    # The finer modes too: torchtitan's op policy, a block's attention alone, its MLP alone.
    finer: list[list[Mode] | None] = [[Mode.TITAN] * n, [Mode.ATTENTION] * n, [Mode.MLP] * n]
    if config.get("circuit"):
        pins = switch_pins(EXACT, n, 1)  # every switch between two exact modes, every block
    elif config.get("pinned"):
        pins = [*schedule(n), *finer]
    else:
        pins = [None] * config.get("steps", 8)
    steps: list[dict[str, Any]] = []
    for step, pinned in enumerate(pins):
        if pinned is not None:
            h.pin_modes(pinned)
        if config.get("oom_at") == step and rank == 1:
            h.report_oom("out of memory (reported by the test)")
        # The ranks of a tensor-parallel group see the same batch; the data-parallel groups see their own.
        gen = torch.Generator().manual_seed(1000 * dp_rank + step)
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        losses, comms = [], []
        for m in (ref, model):
            torch.manual_seed(100 + step)
            with counting() as counts:
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
            comms.append(dict(counts))
            losses.append(loss.detach())
        grads_equal = all_equal((p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters(), strict=True))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        params_equal = all_equal((p, q) for p, q in zip(ref.parameters(), model.parameters(), strict=True))
        steps.append(
            {
                "modes": [m.name for m in h.modes],
                "own": [m.name for m in h.plan.modes_for(h.last_shape, len(h.blocks))],
                "plan_version": h.plan.version,
                "loss_equal": bool(torch.equal(losses[0], losses[1])),
                "grads_equal": grads_equal,
                "params_equal": params_equal,
                "plain_comms": comms[0],
                "rematd_comms": comms[1],
                "recomputed": sum(m != Mode.STORE for m in h.modes),
            }
        )
    agreement = introspect.cycle(h).setup.agreement
    result = {"steps": steps, "adopted": agreement.adopted if agreement is not None else -1}
    h.close()
    finish(result)


if __name__ == "__main__":
    main()
