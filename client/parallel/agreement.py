"""One plan for the ranks that must run one: each step they agree on it, at a fixed cost.

Ranks whose recomputation replays the same collectives (a tensor-parallel group inside one stage; ZeRO-3's
data-parallel group, whose gathers run in lockstep) must recompute the same blocks, or the job hangs or,
worse, trains on mismatched data; ranks that shard one model (FSDP) share one memory shape, and one rank's
out-of-memory error should tighten them all. Pipeline stages never need to agree: each plans for its own
microbatches.

Each rank puts forward the modes its own planner chose for the step (with its out-of-memory retreat, its pins
and its profiling), one code per block ordered by how little the mode keeps, and the group runs the leanest
mode any rank put forward for each block: an all-reduce (maximum) of one integer per block, and one for the
plan's version, over each of the group's process groups (one, or one per dimension of a device mesh), read back
once. Its size is the model's, not the world's; an out-of-memory error on any rank tightens every rank of the
group at its next step. The ranks show the newest version any of them put forward as the plan's, so ranks that
run one plan name it by one version.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import torch

from rematd.planner import Mode

log = logging.getLogger("rematd.client")

CODES = {
    Mode.STORE: 0,
    Mode.COMPRESS: 1,
    Mode.ATTENTION: 2,
    Mode.MLP: 3,
    Mode.SELECTIVE: 4,
    Mode.TITAN: 5,
    Mode.OFFLOAD: 6,
    Mode.RECOMPUTE: 7,
}
"""A mode's code in the agreement: the larger, the less of the block's activations it keeps on the device (in
a typical block: how parts and op policies compare varies from model to model, and any order the ranks share
runs one plan). A block that profiles puts forward recomputing's code (profiling runs it as recomputing does)."""

MODES = {code: mode for mode, code in CODES.items()}

VERSION_CAP = 2**31 - 1
"""The largest plan version the agreement carries (its integers are 32-bit)."""


def leanest(offer: Collection[Mode]) -> Mode:
    """The mode of ``offer`` that keeps the least on the device (recompute when empty)."""
    return max(offer, key=CODES.__getitem__, default=Mode.RECOMPUTE)


class Agreement:
    """Makes the ranks of ``groups`` (process groups whose union is the ranks that agree; ``None`` is the
    default group) run one plan each step."""

    running = False
    """True while an agreement's collectives run (on any rank's training thread): what counts collectives
    can tell them from the model's."""

    def __init__(self, groups: Sequence[object | None], what: str) -> None:
        self.groups = list(groups)
        self.what = what
        """Who agrees, in words (the log, ``describe``)."""
        self.enabled = True
        self.adopted = 0
        """Steps this rank ran modes other than its own planner's."""
        self._checked = False

    @property
    def collectives(self) -> int:
        """Collectives an agreement issues per step (the first step adds as many to check the block counts)."""
        return len(self.groups)

    def describe(self) -> str:
        return (
            f"one plan per step over {self.what} ({self.collectives} all-reduce of an integer per block and one "
            "for the plan's version)"
        )

    def _device(self) -> torch.device:
        import torch.distributed as dist

        backend = str(dist.get_backend(self.groups[0])).lower()  # type: ignore[arg-type]
        if "gloo" in backend or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _max(self, values: Sequence[int]) -> list[int]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int32, device=self._device())
        Agreement.running = True
        try:
            for group in self.groups:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # type: ignore[arg-type]
        finally:
            Agreement.running = False
        return [int(v) for v in t.tolist()]  # the one copy back to the host

    def agree(self, codes: Sequence[int], version: int) -> tuple[list[int], int]:
        """The codes every rank of the group runs this step, from this rank's (one of :data:`CODES` per
        block): per block, the largest any rank put forward; and the plan version the group shows, the newest
        any rank put forward (``version``: this rank's plan's)."""
        if not self.enabled:
            return list(codes), version
        if not self._checked:
            # Every rank must reduce as many codes: a rank with other blocks turns the agreement off everywhere
            # at once, since every rank sees the largest count and the smallest.
            most, least = self._max([len(codes), -len(codes)])
            self._checked = True
            if most != -least:
                self.enabled = False
                log.error(
                    "rematd: the ranks of %s attached %d to %d blocks; they cannot run one plan, and each runs "
                    "its own. Attach the same blocks on every rank of the group",
                    self.what,
                    -least,
                    most,
                )
                return list(codes), version
        *agreed, shown = self._max([*codes, min(version, VERSION_CAP)])
        if agreed != list(codes):
            self.adopted += 1
        return agreed, shown
