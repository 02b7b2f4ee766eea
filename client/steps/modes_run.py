"""What the blocks run at a step's start, held against the plan's table for the step's shape.

Read at every step's start on the training thread: a step like the last one (the same plan, shape and modes)
costs a look at each block's mode and a comparison, nothing more.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from rematd.client.blocks.switchable import MODE_CHANGES, SwitchableBlock
from rematd.planner import Mode, Plan, Shape

_MODE_OF = operator.attrgetter("mode")
_PROFILING_OF = operator.attrgetter("profiling")

STORE_TIMED_EVERY = 8
"""Storing blocks' forwards are timed one step in this many (the baseline the planner weighs what other modes add
in forward against); on the others, where no saved tensors are counted either (on CUDA), they run their own
forward with nothing of rematd's around it."""

RERUN = frozenset({Mode.SELECTIVE, Mode.TITAN, Mode.ATTENTION, Mode.MLP, Mode.RECOMPUTE})
"""Modes whose block runs its forward, or a part of it, again in backward."""


class ModesRun:
    """The modes of the step running, and whether they are its plan's."""

    __slots__ = ("_bare", "_blocks", "_changes", "_plan", "_planned", "_shape", "modes", "profiling", "ran", "rerun")

    def __init__(self) -> None:
        self.modes: tuple[Mode, ...] = ()
        """Each block's mode this step."""
        self.ran: tuple[Mode, ...] = ()
        """The same where they are not the plan's for the step's shape (a pin, the plan the ranks agreed on,
        the leanest modes), or the profiling step's; empty where they are the plan's."""
        self.rerun: tuple[bool, ...] = ()
        """For each block, whether it runs its forward (or a part of it) again in backward."""
        self.profiling = False
        """Whether some block profiles this step."""
        self._changes = -1
        """:data:`MODE_CHANGES` when the blocks were last read."""
        self._blocks: Sequence[SwitchableBlock] | None = None
        self._bare: tuple[object, ...] | None = None
        """What the blocks' running bare was last set for."""
        self._plan: Plan | None = None
        self._shape: Shape | None = None
        self._planned: tuple[Mode, ...] = ()
        """The modes ``_plan``'s table gives a step of ``_shape``."""

    def begin(self, blocks: Sequence[SwitchableBlock], plan: Plan, shape: Shape, *, profiling: bool) -> None:
        """The step starts with the blocks' modes as set; ``profiling``: it is the profiling step."""
        # Each block read only where some block's mode or profiling changed since the last step's start: reading
        # them all costs a cache miss or two per block on a training thread fresh from backward.
        changes = MODE_CHANGES[0]
        if changes != self._changes or blocks is not self._blocks:
            self._changes, self._blocks = changes, blocks
            modes = tuple(map(_MODE_OF, blocks))
            if modes != self.modes:
                self.modes, self.rerun = modes, tuple(m in RERUN for m in modes)
            self.profiling = any(map(_PROFILING_OF, blocks))
        modes = self.modes
        if profiling or self.profiling:
            self.ran = modes  # no plan's: the profile's modes
            return
        if plan is not self._plan or shape is not self._shape:
            self._plan, self._shape, self._planned = plan, shape, plan.modes_for(shape, len(blocks))
        self.ran = () if modes == self._planned else modes

    def run_bare(self, blocks: Sequence[SwitchableBlock], *, step: int, counting: bool) -> None:
        """After :meth:`begin`: which blocks run their own forward this step (step ``step``; ``counting``:
        saved tensors are counted). Set again only where the modes, the profiling or the timing changed."""
        wrapped = counting or step % STORE_TIMED_EVERY == 0
        key = (self.modes, self.profiling, wrapped)
        if key == self._bare:
            return
        self._bare = key
        again = False
        for b in blocks:
            bare = not wrapped and b.may_run_bare
            b.run_bare(bare)
            # Its parts still switched from an earlier mode: this step's forward turns them off, the next one's
            # may run bare.
            again = again or (not wrapped and not bare and b.mode is Mode.STORE and b.parts_switched)
        if again:
            self._bare = None
