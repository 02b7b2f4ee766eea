"""Looking inside a handle: the supported way for tests and tools to read the parts a
:class:`~rematd.client.Handle` keeps private.

A handle's parts (its switchable blocks, its accounting of saved tensors, its offloader, its step bookkeeping,
where its plans come from) are private so that they can change without notice to a training loop. Code that must
look at them reads them through these accessors, so that a change inside the client changes this module rather
than every reader. Nothing here is needed to train: the handle's public attributes (``h.plan``, ``h.history``,
``h.modes``, ``h.last_stats``, ``h.stream``) are, and come first where they say enough.
"""

from __future__ import annotations

import threading

from rematd.client.blocks.offload import Offloader
from rematd.client.blocks.switchable import SwitchableBlock
from rematd.client.handle import Handle
from rematd.client.memory.accounting import SavedTensorAccounting
from rematd.client.plans.background import ThreadedBackend
from rematd.client.plans.sources import Backend, EmbeddedBackend
from rematd.client.service.stream import StreamBackend
from rematd.client.steps.boundaries import StepCycle
from rematd.planner import Plan, PlannerSession
from rematd.planner.messages import Hello

__all__ = [
    "accounting",
    "backend",
    "blocks",
    "cycle",
    "hello",
    "offload_groups",
    "offloader",
    "pending_plan",
    "planning_lock",
    "session",
    "stream_thread",
]


def blocks(h: Handle) -> list[SwitchableBlock]:
    """The handle's switchable blocks, in order (``h.blocks`` has their names, ``h.modes`` their modes)."""
    return h._blocks


def accounting(h: Handle) -> SavedTensorAccounting:
    """The handle's count of the tensors its blocks save for backward (on the CPU)."""
    return h._accounting


def offloader(h: Handle) -> Offloader:
    """What copies the offloading blocks' saved tensors to the host and back."""
    return h._offloader


def offload_groups(off: Offloader) -> int:
    """How many blocks' forwards ``off`` still holds host copies for (none once every backward or the step end
    took them)."""
    return len(off._groups)


def cycle(h: Handle) -> StepCycle:
    """The handle's step bookkeeping: its memory source, its sharded set-up, the errors it caught and went on."""
    return h._cycle


def backend(h: Handle) -> Backend:
    """Where the handle's plans come from: the planner in this process (on its thread or the training thread's),
    or a service's stream."""
    return h._backend


def hello(h: Handle) -> Hello:
    """The hello the handle's planner was opened with as it stands now (a served one with what a reconnect
    would send); LookupError before the first step's end opened it."""
    source = h._backend
    if isinstance(source, StreamBackend):
        if source._hello is None:
            raise LookupError("the stream is not open yet: its hello is sent at the first step's end")
        return source._current_hello()
    opened = source.hello if isinstance(source, EmbeddedBackend | ThreadedBackend) else None
    if opened is None:
        raise LookupError("the planner is not open yet: its hello is made at the first step's end")
    return opened


def session(h: Handle) -> PlannerSession | None:
    """The rank's planner in this process, once open (read it after ``h.flush()``: its thread changes it);
    TypeError when a service plans."""
    source = h._backend
    if not isinstance(source, EmbeddedBackend | ThreadedBackend):
        raise TypeError(f"a service plans for this handle ({type(source).__name__}): no planner in this process")
    return source.session


def planning_lock(source: ThreadedBackend) -> threading.Lock:
    """Held while the planner's thread runs a call: holding it from outside stands for a planner busy with a
    long search, while the training thread goes on."""
    return source._planning


def pending_plan(h: Handle) -> Plan | None:
    """The planner's newest answer, waiting for the next step to apply it (None when there is none)."""
    return h._applier._pending


def stream_thread(stream: StreamBackend) -> threading.Thread | None:
    """The thread that talks to the service (None before the stream opens): it ends only when the stream does."""
    return stream._thread


def queued(source: ThreadedBackend) -> int:
    """Calls and steps' figures waiting for the planner's thread."""
    return len(source._queue)
