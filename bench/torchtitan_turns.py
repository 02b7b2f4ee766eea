"""Several torchtitan trainers in one process, taking their steps in turn: contenders timed on the same machine
at the same moments.

    torchrun --standalone --nproc-per-node 1 -m bench.torchtitan_turns PLAN.json

Run as separate processes one after another, two runs of the same computation on a shared 2-core VM differed by
up to 28%, more than what sets torchtitan's checkpointing modes and rematd's plans apart. Here every contender's
trainer is built first (torchtitan's ``Trainer`` or rematd's, from its own arguments), then step ``k`` of every
contender runs before step ``k + 1`` of any, each round in a rotated order: a machine that slows or speeds up
weighs on all alike, and the ratios come from one run, as for ``bench.phases``.

``PLAN.json`` holds ``common`` (torchtitan's arguments for every contender), ``contenders`` (a list of
``{"name", "module", "args"}``, ``module`` ``torchtitan.train`` or ``rematd.integrations.torchtitan``),
``steps``, ``profile_step`` (that step's peak of CPU memory above its start is taken with torch's memory
profiler, which slows it) and ``out`` (a folder): each contender's record goes to ``out/<index>.rank<rank>.pt``, in
:mod:`bench.torchtitan_cpu`'s layout (``losses``, ``steps``, ``seconds``, ``peaks``). The stand-ins the CPU
needs (:func:`bench.torchtitan_cpu.install`) are installed first. Every rank builds the same trainers and
steps them in the same order, so the collectives of two ranks pair up.

Every contender's trainer is alive throughout, and rematd's planners run on their own threads while other
contenders step: a rematd that plans costs every contender a little of the CPU, torchtitan's modes included.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any, TypeVar

import torch

from bench.torchtitan_cpu import _stats, _whole, install, timed_step

TITAN, REMATD = "torchtitan.train", "rematd.integrations.torchtitan"
T = TypeVar("T")


class Contender:
    """One trainer, its data and what it recorded."""

    def __init__(self, name: str, trainer: Any) -> None:
        self.name = name
        self.trainer = trainer
        self.data = trainer.batch_generator(trainer.dataloader)
        self.losses: list[torch.Tensor] = []
        self.seconds: list[float] = []
        self.peaks: list[int] = []
        self.steps: list[list[dict[str, Any]]] = []
        forward_backward = trainer.forward_backward_step

        def recorded(**kwargs: Any) -> torch.Tensor:
            loss = forward_backward(**kwargs)
            self.losses.append(_whole(loss))  # a distributed tensor under tensor parallel's loss parallelism
            return loss  # type: ignore[no-any-return]

        trainer.forward_backward_step = recorded

    def step(self, profiled: bool) -> None:
        """The trainer's next step, as its own loop takes it (its collector first), timed; ``profiled``, under
        torch's memory profiler (which slows it)."""
        t = self.trainer
        t.step += 1
        t.gc_handler.run(t.step)
        timed_step(lambda: t.train_step(self.data), profiled=profiled, seconds=self.seconds, peaks=self.peaks)
        self.steps.append([_stats(a.handle) for a in getattr(t, "rematd", [])])

    def record(self) -> dict[str, Any]:
        return {"losses": self.losses, "steps": self.steps, "seconds": self.seconds, "peaks": self.peaks}


def build(module: str, argv: list[str]) -> Any:
    """A trainer from torchtitan's arguments, as ``python -m module argv`` builds it."""
    if module == REMATD:
        from rematd.integrations.torchtitan import RematdConfigManager

        return RematdConfigManager().parse_args(argv).build()
    if module == TITAN:
        from torchtitan.config import ConfigManager

        return ConfigManager().parse_args(argv).build()
    raise ValueError(f"module {module!r}: expected {TITAN!r} or {REMATD!r}")


def order(contenders: list[T], round_: int) -> list[T]:
    """Round ``round_``'s order: rotated by one a round, so that each contender takes every place in turn, and
    reversed for as many rounds after those, so that none keeps following the same one."""
    k = round_ % len(contenders)
    turned = contenders[k:] + contenders[:k]
    return turned[::-1] if (round_ // len(contenders)) % 2 else turned


def main(argv: list[str] | None = None) -> None:
    (plan_path,) = sys.argv[1:] if argv is None else argv
    plan = json.loads(Path(plan_path).read_text())
    install()
    from torchtitan.tools.logging import init_logger

    init_logger()
    out = Path(plan["out"])
    contenders = [
        Contender(c["name"], build(c["module"], [*plan["common"], "--dump-folder", str(out / f"dump{i}"), *c["args"]]))
        for i, c in enumerate(plan["contenders"])
    ]
    try:
        for round_ in range(plan["steps"]):
            for c in order(contenders, round_):
                c.step(profiled=round_ + 1 == plan["profile_step"])
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        for i, c in enumerate(contenders):
            torch.save(c.record(), out / f"{i}.rank{rank}.pt")
    finally:
        for c in contenders:
            c.trainer.close()
        gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
