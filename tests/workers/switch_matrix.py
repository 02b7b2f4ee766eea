"""One rank of the switch-matrix test: every ordered pair of modes, switched into and out of, under DeepSpeed
ZeRO (stages 1-3, parameters released after use or kept) and under FSDP2, against the same training without
rematd.

The pins walk a circuit through every ordered pair of distinct modes (``circuit``): block ``i`` runs the
circuit's mode ``k + i`` at pin ``k``, so every block makes every switch once and the plans in between mix
modes (a recomputing block beside a selective one beside a stored one). Each pin is held ``hold`` steps (two
by default): the first step after a switch lets ZeRO-3 record its new fetch order, the second prefetches along
it, and the next switch lands on a trace ZeRO-3 has established (a switch into selective from there is what
once failed). Written per step: the modes pinned and run, whether loss and parameters are bitwise those
without rematd, and how far apart they are (compress is lossy: close, not equal).

Only the handle's public attributes are read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from rematd import client
from rematd.planner import Mode
from tests.workers.rank import finish, settings, start

EXACT = (Mode.STORE, Mode.SELECTIVE, Mode.TITAN, Mode.ATTENTION, Mode.MLP, Mode.RECOMPUTE)
"""The modes that train bitwise as storing does (offload is CUDA's alone)."""


def circuit(modes: Sequence[Mode]) -> list[Mode]:
    """A closed walk over ``modes`` that takes every ordered pair of distinct modes once (an Euler circuit of
    the complete directed graph): 6 switches for 3 modes, 12 for 4. Its first mode closes it."""
    left = {a: [b for b in modes if b != a] for a in modes}
    stack, walk = [modes[0]], []
    while stack:  # Hierholzer's algorithm
        at = stack[-1]
        if left[at]:
            stack.append(left[at].pop(0))
        else:
            walk.append(stack.pop())
    return walk[::-1]


def rounds(cycle: list[Mode], blocks: int, hold: int) -> list[list[Mode] | None]:
    """Each block along ``cycle`` from its own offset, a pin per position held ``hold`` steps, one position more
    than the cycle so that every block makes every switch of it."""
    return [[cycle[(k + i) % len(cycle)] for i in range(blocks)] for k in range(len(cycle) + 1) for _ in range(hold)]


def pins(modes: Sequence[Mode], blocks: int, hold: int) -> list[list[Mode] | None]:
    """None for the profiling step; then every switch between the exact modes; then, with compress offered,
    every exact mode into compress and out of it (after the exact part: compress is lossy, and what follows it
    is no longer bitwise comparable)."""
    exact = [m for m in modes if m in EXACT]
    steps: list[list[Mode] | None] = [None]
    steps += rounds(circuit(exact)[:-1], blocks, hold)
    if Mode.COMPRESS in modes:
        steps += rounds([x for m in exact for x in (m, Mode.COMPRESS)], blocks, hold)
    return steps


def bitwise(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[bool, float]:
    pairs = list(zip(a, b, strict=True))
    return all(torch.equal(x, y) for x, y in pairs), max(float((x.float() - y.float()).abs().max()) for x, y in pairs)


def record(pinned: list[Mode] | None, h: client.Handle, losses: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    return {
        "pinned": [m.name for m in pinned] if pinned else None,
        "modes": [m.name for m in h.modes],
        "loss_equal": bool(torch.equal(losses[0], losses[1])),
        "losses": [float(losses[0].float()), float(losses[1].float())],
    }


# -- DeepSpeed ------------------------------------------------------------------------------------------------


def deepspeed_case(case: dict[str, Any], rank: int) -> dict[str, Any]:
    import deepspeed

    from tests.workers.deepspeed_exact import engines, micro_step, partitions

    deepspeed.utils.logger.setLevel(logging.WARNING)
    ref, engine, h = engines(case)
    steps = []
    for step, pinned in enumerate(pins(case_modes(case), len(h.blocks), case.get("hold", 2))):
        if pinned is not None:
            h.pin_modes(pinned)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1000 * rank + step))
        ref_loss, _ = micro_step(ref, ids, 100 + 10 * rank + step, count=False)
        loss, _ = micro_step(engine, ids, 100 + 10 * rank + step, count=False)
        row = record(pinned, h, (ref_loss, loss))
        row["params_equal"], row["max_diff"] = bitwise(partitions(ref), partitions(engine))
        steps.append(row)
    result = {"case": case, "steps": steps, "step_count": h.step_count, "lossy": [p.lossy for p in h.history]}
    h.close()
    return result


# -- FSDP2 ----------------------------------------------------------------------------------------------------


def fsdp_case(case: dict[str, Any], rank: int) -> dict[str, Any]:
    from tests.workers.fsdp_exact import VOCAB, build, full, shard

    ref, model = build(case["model"]), build(case["model"])
    shard(ref, case)
    h = client.attach(model, modes=case.get("modes"))
    shard(model, case)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    h.optimizer = opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = []
    for step, pinned in enumerate(pins(case_modes(case), len(h.blocks), case.get("hold", 2))):
        if pinned is not None:
            h.pin_modes(pinned)
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1000 * rank + step))
        losses = []
        for m, o in ((ref, opt_ref), (model, opt)):
            torch.manual_seed(100 + 10 * rank + step)  # dropout draws the same numbers in both
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        row = record(pinned, h, (losses[0], losses[1]))
        row["params_equal"], row["max_diff"] = bitwise(
            [full(p) for p in ref.parameters()],  # type: ignore[misc]
            [full(q) for q in model.parameters()],  # type: ignore[misc]
        )
        steps.append(row)
    result = {"case": case, "steps": steps, "step_count": h.step_count, "lossy": [p.lossy for p in h.history]}
    h.close()
    return result


def case_modes(case: dict[str, Any]) -> tuple[Mode, ...]:
    return tuple(Mode[m.upper()] for m in case.get("modes") or [m.label for m in EXACT])


def main() -> None:
    config = settings()
    if config["with"] == "deepspeed":
        import deepspeed

        torch.set_num_threads(1)
        deepspeed.init_distributed(dist_backend="gloo")
        rank = torch.distributed.get_rank()
        results = [deepspeed_case(case, rank) for case in config["cases"]]
    else:
        rank = start()
        results = [fsdp_case(case, rank) for case in config["cases"]]
    finish(results, exit_now=config["with"] == "deepspeed")


if __name__ == "__main__":
    main()
