"""One rank of a sharded job streaming to a live service (``REMATD_SERVER``): each rank has its own budget,
so the plans the service sends them differ, and the ranks must still run one plan, step after step."""

from __future__ import annotations

import os
from typing import Any

import torch

from rematd import client
from rematd.client import introspect
from tests.workers.fsdp_exact import VOCAB, build, shard
from tests.workers.rank import finish, settings, start


def main() -> None:
    rank = start()
    config = settings()
    model = build("llama")
    h = client.attach(model, server=os.environ["REMATD_SERVER"], job="fsdp-served", budget_bytes=config[rank])
    shard(model, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    h.optimizer = opt
    steps: list[dict[str, Any]] = []
    for step in range(6):
        gen = torch.Generator().manual_seed(100 * rank + step)
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert h.flush(30.0), "the service did not answer"
        steps.append({"modes": [m.name for m in h.modes], "plan_version": h.plan.version})
    agreement = introspect.cycle(h).setup.agreement
    result = {"steps": steps, "adopted": agreement.adopted if agreement is not None else -1, "rank": h.rank}
    h.close()
    finish(result)


if __name__ == "__main__":
    main()
