"""One plan for every rank of a job: at each step's start the ranks agree on the leanest of their plans.

Under tensor or sequence parallel a block's forward holds collectives, and a
recomputation replays them: the ranks of a group must recompute the same
blocks or the job hangs, or, worse, trains on mismatched data. Under FSDP
every rank has the same memory shape and one rank's out-of-memory error ends
the whole job. So, for a sharded model, each rank puts forward the modes its
own planner chose for the step (with its out-of-memory retreat, its pins and
its profiling) and every rank runs the plan of the rank whose plan keeps the
least: an OOM or a tighter correction on any rank tightens every rank at its
next step, whichever service worker, replica or in-process planner made it.

The agreement is one small all-gather per step (the blocks' mode codes and a
leanness score), at the first forward of the step, when every rank is there.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import torch

from rematd.planner import Mode

log = logging.getLogger("rematd.client")

PROFILING = 0
"""The code of a block that profiles this step: it runs as storing does."""

_LEANNESS = {Mode.STORE: 0, Mode.COMPRESS: 1, Mode.SELECTIVE: 1, Mode.OFFLOAD: 2, Mode.RECOMPUTE: 2}
"""How much of a block's activations a mode keeps off the device, in order: more is leaner."""


def leanest(offer: Collection[Mode]) -> Mode:
    """The mode of ``offer`` that keeps the least on the device (recompute among equals; recompute when empty)."""
    return max(offer, key=lambda m: (_LEANNESS[m], m is Mode.RECOMPUTE), default=Mode.RECOMPUTE)


def leanness(codes: Sequence[int]) -> int:
    """A plan's score: the larger, the less it keeps (profiling counts as storing)."""
    return sum(_LEANNESS.get(Mode(c), 0) for c in codes if c != PROFILING)


class PlanAgreement:
    """Makes the ranks of ``group`` (default: every rank) run one plan each step."""

    def __init__(self, group: object | None = None) -> None:
        self.group = group
        self.enabled = True
        self.adopted = 0
        """Steps this rank ran another rank's plan instead of its own."""
        self._checked = False

    def _device(self) -> torch.device:
        import torch.distributed as dist

        backend = str(dist.get_backend(self.group)).lower()  # type: ignore[arg-type]
        if "gloo" in backend or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _gather(self, row: list[int]) -> list[list[int]]:
        import torch.distributed as dist

        device = self._device()
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        world = dist.get_world_size(self.group)  # type: ignore[arg-type]
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=self.group)  # type: ignore[arg-type]
        return [r.tolist() for r in rows]

    def agree(self, codes: Sequence[int]) -> list[int]:
        """The codes every rank runs this step, from this rank's ``codes`` (a :class:`Mode` value per block,
        or :data:`PROFILING`): those of the leanest rank's plan, the lowest rank's among equals."""
        if not self.enabled:
            return list(codes)
        if not self._checked:
            # Every rank must gather rows of one length: a rank with other blocks turns the agreement off
            # everywhere at once, since every rank sees every count.
            counts = self._gather([len(codes)])
            self._checked = True
            if len({c[0] for c in counts}) != 1:
                self.enabled = False
                log.error(
                    "rematd: the ranks attached different numbers of blocks (%s); they cannot run one plan, "
                    "and each runs its own. Attach the same model on every rank",
                    sorted({c[0] for c in counts}),
                )
                return list(codes)
        rows = self._gather([leanness(codes), *codes])
        best = max(range(len(rows)), key=lambda r: (rows[r][0], -r))
        chosen = rows[best][1:]
        if chosen != list(codes):
            self.adopted += 1
        return chosen
