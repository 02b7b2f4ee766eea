"""One rank of the FSDP2 compress test: a tiny GPT-2 run with plain FSDP2 and with rematd side by side at the same
weights (no optimizer step: every step compares gradients of the same weights), rematd's blocks pinned to compress,
to store, and to compress again. Written per step: whether the losses are equal, the
full gradients' relative error and cosine against plain FSDP2, and the bytes saved for backward at the peak."""

from __future__ import annotations

from typing import Any

import torch

from rematd import client
from rematd.client.blocks.compress import CompressConfig
from tests.workers.fsdp_exact import VOCAB, build, full, shard
from tests.workers.rank import finish, start

SCHEDULE = ["compress", "store", "compress"]


def gradients(model: torch.nn.Module) -> torch.Tensor:
    flat = [full(p.grad).flatten() for p in model.parameters() if p.grad is not None]  # type: ignore[union-attr]
    return torch.cat(flat).double()  # float64: a float32 cosine strays past 1 by rounding alone


def run(rank: int) -> list[dict[str, Any]]:
    case = {"model": "gpt2"}
    ref, model = build("gpt2"), build("gpt2")
    shard(ref, case)
    shard(model, case)
    h = client.attach(model, modes=["store", "recompute", "compress"], compress=CompressConfig(min_bytes=0))
    steps = []
    for step, pinned in enumerate([None, *SCHEDULE]):
        if pinned is not None:
            h.pin_modes(pinned)
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1000 * rank + step))
        losses = []
        for m in (ref, model):
            torch.manual_seed(100 + 10 * rank + step)  # dropout draws the same numbers in both
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        g_ref, g = gradients(ref), gradients(model)
        h.step()
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        stats = h.last_stats
        steps.append(
            {
                "pinned": pinned,
                "modes": [m.name for m in h.modes],
                "loss": float(losses[1]),
                "loss_equal": bool(torch.equal(losses[0], losses[1])),
                "error": float((g - g_ref).norm() / g_ref.norm()),
                "cosine": float(torch.nn.functional.cosine_similarity(g, g_ref, dim=0)),
                "saved_peak_bytes": stats.saved_peak_bytes if stats is not None else 0,
            }
        )
    h.close()
    return steps


def main() -> None:
    rank = start()
    finish(run(rank))


if __name__ == "__main__":
    main()
