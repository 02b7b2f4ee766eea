"""Two ranks that run one plan (``same_plan=True``), each training the same mixture of experts, whose routers on
chosen steps send every token to rank 0's experts (rank 1's receive none): what each rank ran and measured."""

from __future__ import annotations

from typing import Any

import torch

from rematd import client
from rematd.client.introspect import blocks
from tests.moe_models import TinyMoE, loss_of
from tests.workers.rank import finish, settings, start


def main() -> None:
    rank = start()
    config: dict[str, Any] = settings()
    torch.manual_seed(0)
    model = TinyMoE(layers=config["layers"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(
        model, optimizer=opt, budget_bytes=config["budgets"][rank], same_plan=True, modes=config.get("modes")
    )
    data = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    steps = []
    for step in range(config["steps"]):
        model.skew((0 if rank == 0 else 7) if step in config["skewed"] else None)
        loss = loss_of(model, data)
        loss.backward()
        opt.step()
        opt.zero_grad()
        h.flush(30.0)  # the planner's answer to this step before the next: the ranks' planners see alike
        stats = h.last_stats
        assert stats is not None
        steps.append(
            {
                "ran": "".join(b.mode.letter for b in blocks(h)),
                "peak": stats.saved_peak_bytes,
                "routed": stats.routed_bytes,
                "reason": h.plan.reason,
                "loss": loss.item(),
            }
        )
    finish(steps)


if __name__ == "__main__":
    main()
