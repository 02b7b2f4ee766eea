"""One rank of the FSDP2 experts test: blocks whose experts' weights FSDP keeps on a device mesh of their own.

Structured as torchtitan shards a mixture of experts under expert parallel: each block is one ``fully_shard``
unit with bfloat16 parameters, whose ``shard_placement_fn`` puts the experts' weights on a mesh of one rank (each
rank keeps its experts whole) and the other parameters on the data-parallel mesh of both, so that FSDP keeps two
parameter groups for the unit. The experts' forward casts its weights to bfloat16 (a no-op on gathered bfloat16
parameters, which the matrix products then save for backward) as torchtitan's grouped experts do. Every block is
pinned to store; each step's activations as the CPU's count measures them and as the profile prices them are
written, with the storages of the experts' gathered weights and those rematd leaves out as weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import Shard

from rematd import client
from rematd.client import introspect
from rematd.client.memory.accounting import storage_id
from rematd.client.parallel.fsdp import Fsdp
from tests.workers.rank import finish, start

DIM, HIDDEN, EXPERTS, TOKENS = 32, 128, 8, 16


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.1)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.bfloat16()
        h = torch.nn.functional.silu(torch.bmm(x, self.w1.bfloat16().transpose(-2, -1)))
        return torch.bmm(h, self.w2.bfloat16().transpose(-2, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(x)
        tokens = h.reshape(-1, DIM)
        scores = torch.softmax(self.router(tokens).float(), dim=-1)
        # Every token to every expert, weighted by its score: the experts' weights in one batched product.
        out = self.experts(tokens.unsqueeze(0).expand(EXPERTS, -1, -1))
        mixed = (out.float() * scores.t().unsqueeze(-1)).sum(0)
        return h + mixed.to(h.dtype).reshape(h.shape)


class Model(nn.Module):
    def __init__(self, n_layer: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


def shard(model: Model) -> None:
    dp = init_device_mesh("cpu", (2,))
    ep = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "efsdp"))["efsdp"]
    dp_info, ep_info = FSDPMeshInfo(dp, shard_mesh_dim=0), FSDPMeshInfo(ep, shard_mesh_dim=0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        experts = set(layer.experts.parameters())

        def place(p: nn.Parameter, experts: set[nn.Parameter] = experts) -> ShardPlacementResult:
            return ShardPlacementResult(placement=Shard(0), mesh_info=ep_info if p in experts else dp_info)

        fully_shard(layer, mesh=dp, mp_policy=mp, shard_placement_fn=place)
    fully_shard(model, mesh=dp, mp_policy=mp)


def main() -> None:
    rank = start()
    torch.manual_seed(0)
    model = Model()
    shard(model)
    h = client.attach(model, blocks=list(model.layers), planner_thread=False)
    h.pin_modes("store")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    h.optimizer = opt
    gathered: set[int] = set()
    for layer in model.layers:
        # Inside the experts' forward FSDP has swapped in their gathered (bfloat16) weights.
        layer.experts.register_forward_pre_hook(
            lambda m, _args: gathered.update(i for p in m.parameters() if (i := storage_id(p)) is not None)
        )
    steps: list[dict[str, Any]] = []
    for n in range(4):
        gen = torch.Generator().manual_seed(100 * rank + n)
        model(torch.randn(2, TOKENS, DIM, generator=gen)).backward()
        opt.step()
        opt.zero_grad()
        stats = h.last_stats
        assert stats is not None
        steps.append(
            {
                "measured": stats.saved_peak_bytes - stats.static_bytes,
                "priced": h.plan.predicted_peak_bytes - stats.static_bytes,
                "modes": [m.name for m in h.modes],
            }
        )
    setup = introspect.cycle(h).setup
    assert isinstance(setup, Fsdp)
    weights = setup.weight_storages()
    expert_bytes = sum(p.numel() for layer in model.layers for p in layer.experts.parameters()) * 2
    block_bytes = sum(p.numel() for p in model.layers[0].parameters()) * 2  # gathered in bfloat16
    h.close()
    finish(
        {
            "steps": steps,
            "experts_gathered": len(gathered),
            "experts_left_out": len(gathered & weights),
            "expert_bytes": expert_bytes,
            "block_bytes": block_bytes,
            "gathered_at_peak": setup.gathered_at_peak,
            "groups": [len(layer._get_fsdp_state()._fsdp_param_groups) for layer in model.layers],
        }
    )


if __name__ == "__main__":
    main()
