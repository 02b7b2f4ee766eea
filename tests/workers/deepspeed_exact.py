"""One rank of the DeepSpeed exactness test: one model trained by a plain engine and by an engine rematd is
attached to, side by side.

For each case of ``REMATD_CONFIG`` (model, ZeRO stage, attach before ``deepspeed.initialize`` or to the
engine after, whether ZeRO-3 releases parameters after use, gradient accumulation, bf16), both engines take
the same micro-batches with dropout on while rematd's modes are pinned through store, selective, recompute
and a mix. Written per step: whether the losses and this rank's parameters (ZeRO-3: its partitions) are
bitwise equal, the collectives each engine issued in forward and backward, and which blocks ran again.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from contextlib import nullcontext
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch

from bench.collectives import counting
from rematd import client
from rematd.client import introspect
from rematd.client.parallel.zero import Zero3
from rematd.planner import Mode
from tests.model_matrix import Rematerialised
from tests.workers.deepspeed_models import VOCAB, build, ds_config
from tests.workers.rank import finish, settings

deepspeed.utils.logger.setLevel(logging.WARNING)


def schedule(n: int, case: dict[str, Any]) -> list[list[Mode] | None]:
    """A new pin every step, or (``hold``) each pin held three steps: what a switch costs shows after it."""
    mixed = [(Mode.SELECTIVE, Mode.RECOMPUTE, Mode.STORE)[i % 3] for i in range(n)]
    if case.get("hold"):
        # The profiling step recomputes every block: selective reruns them in the same order, storing is a switch
        # (to fewer gathers), the mix a switch to more.
        return [None, *[[Mode.SELECTIVE] * n] * 3, *[[Mode.STORE] * n] * 3, *[mixed] * 3]
    plan = [None, [Mode.SELECTIVE] * n, [Mode.RECOMPUTE] * n, mixed, [Mode.STORE] * n, [Mode.RECOMPUTE] * n]
    return plan[: case.get("steps", 6)]


def engines(case: dict[str, Any]) -> tuple[Any, Any, client.Handle]:
    """The plain engine, rematd's engine and its handle, attached as the case says."""
    config = ds_config(case)
    ref = build(case["model"])
    ref_engine, *_ = deepspeed.initialize(
        model=ref, optimizer=torch.optim.AdamW(ref.parameters(), lr=1e-2), config=config
    )
    model = build(case["model"])
    h = client.attach(model, modes=case.get("modes")) if case["order"] == "before" else None
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config
    )
    if h is None:
        h = client.attach(engine, modes=case.get("modes"))
    else:
        h.engine = engine  # made after attach: the handle follows its step from here
    return ref_engine, engine, h


def partitions(engine: Any) -> list[torch.Tensor]:
    """This rank's parameters as the engine keeps them (ZeRO-3: the partitions)."""
    return [getattr(p, "ds_tensor", p).detach().clone() for p in engine.module.parameters()]


def micro_step(engine: Any, ids: torch.Tensor, seed: int, *, count: bool = True) -> tuple[torch.Tensor, dict[str, int]]:
    """One micro-batch, forward, backward and the engine's step; with ``count``, the collectives it issued
    (every operation then passes a dispatch mode: some 15% of a ZeRO-3 step on these tiny models)."""
    torch.manual_seed(seed)  # dropout draws the same numbers in both engines
    with counting() if count else nullcontext(Counter[str]()) as counts:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
    engine.step()
    return loss.detach(), dict(counts)


def add(total: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v


def train_step(pair: tuple[Any, Any], case: dict[str, Any], rank: int, step: int) -> dict[str, Any]:
    losses: list[list[torch.Tensor]] = [[], []]
    comms: list[dict[str, int]] = [{}, {}]
    for micro in range(case.get("accumulation", 1)):
        gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        for i, engine in enumerate(pair):
            loss, counts = micro_step(engine, ids, 100 + 10 * rank + 3 * step + micro)
            losses[i].append(loss)
            add(comms[i], counts)
    params = list(zip(partitions(pair[0]), partitions(pair[1]), strict=True))
    return {
        "loss_equal": all(torch.equal(a, b) for a, b in zip(*losses, strict=True)),
        "loss": float(losses[0][-1].float()),
        "params_equal": all(torch.equal(a, b) for a, b in params),
        "max_diff": max(float((a.float() - b.float()).abs().max()) for a, b in params),
        "plain_comms": comms[0],
        "rematd_comms": comms[1],
    }


def run_case(case: dict[str, Any], rank: int) -> dict[str, Any]:
    ref_engine, engine, h = engines(case)
    names = dict(engine.module.named_modules())
    counter = Rematerialised([names[n] for n in h.blocks])
    steps: list[dict[str, Any]] = []
    for step, pinned in enumerate(schedule(len(h.blocks), case)):
        if pinned is not None:
            h.pin_modes(pinned)
        record = train_step((ref_engine, engine), case, rank, step)
        record.update(
            pinned=[m.name for m in pinned] if pinned else None, modes=[m.name for m in h.modes], rerun=counter.take()
        )
        steps.append(record)
    zero = introspect.cycle(h).setup
    result = {
        "case": case,
        "steps": steps,
        "step_count": h.step_count,
        "blocks": h.blocks,
        "restarts": zero.restarts if isinstance(zero, Zero3) else None,
        "agreed": introspect.cycle(h).setup.agreement is not None,
        "static": h.last_stats.static_bytes if h.last_stats is not None else None,
    }
    counter.remove()
    h.close()
    return result


def without_restarts(case: dict[str, Any], rank: int) -> dict[str, Any]:
    """The case with ZeRO-3's trace left to find a switch by itself: what a switch costs without rematd's help."""
    own = Zero3.switched
    Zero3.switched = lambda self, modes: None  # type: ignore[method-assign]
    try:
        return run_case(case, rank)
    finally:
        Zero3.switched = own  # type: ignore[method-assign]


def main() -> None:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = [(run_case if case.get("restart", True) else without_restarts)(case, rank) for case in settings()]
    finish(results, exit_now=True)


if __name__ == "__main__":
    main()
