"""One rank of the FSDP2 memory test, on the CPU's saved-tensor accounting.

The same Llama is profiled unsharded and sharded (torchtitan's order): the blocks' profiles must not count
FSDP's gathered weights as activations, and the sharded hello must carry FSDP's memory (the rank's shards as
static bytes, the parameters gathered at the peak as a constant). Then the budget is cut to fit 60% of the
activations and the planner must checkpoint, keep each step's measured peak under the budget, and predict it.
"""

from __future__ import annotations

from typing import Any

import torch

from rematd import client
from rematd.client import introspect
from rematd.client.parallel.fsdp import Fsdp
from tests.workers.fsdp_exact import VOCAB, build, shard
from tests.workers.rank import finish, start


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, n: int, seq: int = 16) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + n)
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    rank = start()
    result: dict[str, Any] = {}

    plain = build("llama")
    h = client.attach(plain)
    opt: torch.optim.Optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    h.optimizer = opt
    step(plain, opt, rank, 0)
    result["plain_saved"] = [b.saved_bytes for b in introspect.hello(h).blocks]
    h.close()

    model = build("llama")
    h = client.attach(model)
    shard(model, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    h.optimizer = opt
    step(model, opt, rank, 0)
    # The hello as the profiling step made it (the first step after it corrects its static memory).
    first_static = introspect.hello(h).static_bytes
    for n in range(1, 3):
        step(model, opt, rank, n)
    hello = introspect.hello(h)
    sharded = introspect.cycle(h).setup
    assert isinstance(sharded, Fsdp)
    stats = h.last_stats
    assert stats is not None
    result.update(
        sharded_saved=[b.saved_bytes for b in hello.blocks],
        other_terms=[[t.bytes, t.batch_exp, t.seq_exp] for t in hello.other_activations.terms],
        gathered=sharded.gathered_at_peak,
        hello_static=first_static,
        hello_static_after=hello.static_bytes,
        static=stats.static_bytes,
        store_peak=stats.saved_peak_bytes,
        shard_bytes=sharded.shard_bytes(opt),
        full_param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
    )
    activations = stats.saved_peak_bytes - stats.static_bytes
    budget = stats.static_bytes + int(0.6 * activations)
    h.budget_bytes = budget
    runs = []
    for n in range(3, 9):
        step(model, opt, rank, n)
        s = h.last_stats
        assert s is not None
        runs.append(
            {
                "peak": s.saved_peak_bytes,
                "predicted": h.plan.predicted_peak_bytes,
                "version": h.plan.version,
                "modes": [m.name for m in h.modes],
            }
        )
    result.update(budget=budget, runs=runs)
    h.close()
    finish(result)


if __name__ == "__main__":
    main()
