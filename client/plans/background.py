"""The in-process planner on a thread of its own: the training thread hands over a step's figures and goes on.

A planner's look for a plan worth a trial, a refit of its step-time model or a new budget's search takes
milliseconds to tens of them; run on the training thread, that is a stall of the step it lands on, and in a
data-parallel job of every rank, which waits for the slowest at the next collective. Here the training thread
only queues the step's statistics; the plan the planner makes from them is kept by the applier and swapped in
at the next step boundary where it is ready (one step or more later, as a service's are). Handing a step over is
an append to a deque: while steps come, the planner's thread looks for them about once a step instead of being
woken for each (a wake-up costs the training thread tens of microseconds); after :data:`IDLE_S` without one it
sleeps until the next wakes it. A hello, a budget, an out-of-memory error or a step of a new length wakes it at
once.

The planner's thread still takes the interpreter's lock from the training thread while it runs, so its work
is kept small where it learns nothing: once a plan has held with no risk and no loosening under way, steady
steps are folded into one report every :data:`MAX_INTERVAL_S` (by the rule a service folds a stream's by), and a
step that differs goes to the planner at once. While the planner is behind, a step like the one queued before it
joins it: its work keeps pace with the steps whatever they cost it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rematd.client.plans.sources import EmbeddedBackend, PlanCallback
from rematd.client.service.budget_hold import BudgetHold
from rematd.client.service.folding import Folder, fold, steady
from rematd.client.service.mailbox import IDLE_S, MAX_POLL_S, MIN_POLL_S
from rematd.client.service.step_record import StepRecord
from rematd.planner import Mode, Plan, PlannerSession, Shape
from rematd.planner.messages import Hello, OomReport, StepStats
from rematd.planner.quiet import QUIET_STEPS, report_interval

log = logging.getLogger("rematd.client")

MAX_QUEUED = 1024
"""Calls waiting for the planner at most: a planner that fell this far behind skips steps' statistics (counted in
``dropped``) rather than hold more of them."""

THREAD_NAME = "rematd-planner"


MAX_INTERVAL_S = 10.0
"""Seconds of steady steps folded into one report at most, as a service allows by default."""


class ThreadedBackend:
    """:class:`EmbeddedBackend`'s planner, run on a named daemon thread; no method waits for it but
    :meth:`flush` and :meth:`close`."""

    served = False
    budget_hold = BudgetHold.UNTIL_TAKEN

    def __init__(self, on_plan: PlanCallback, on_budget_taken: Callable[[], None] = lambda: None) -> None:
        self._on_plan = on_plan
        self._planner = EmbeddedBackend(self._delivered)
        self._folder = Folder()
        """Steady steps folded (on the planner's thread, off the training thread's step)."""
        self._interval = 0.0
        self._planned = False
        self._steps_on_plan = 0
        self._on_budget_taken = on_budget_taken
        """Called on the planner's thread once it has taken in a new budget (its plan for it handed over first)."""
        self._planning = threading.Lock()
        """Held while the planner runs a call; nothing on the training thread waits for it (a price reads the session
        without it), so holding it from outside stands for a planner busy with a long search."""
        self._cond = threading.Condition()
        self._queue: deque[tuple[Callable[[], None] | None, StepRecord | None]] = deque()
        """Calls for the planner, or a step's figures (no call)."""
        self._busy = False
        self._stopping = False
        self._sleeping = False
        """Whether the planner's thread waits to be woken (it has seen no step for :data:`IDLE_S`); else it looks
        for steps' statistics every step or so."""
        self._poll = MAX_POLL_S
        self._last_shape: Shape | None = None
        """The shape of the last step handed over (training thread only)."""
        self._thread: threading.Thread | None = None
        self._opened: Hello | None = None
        self.dropped = 0
        """Steps' statistics the planner never saw: it fell :data:`MAX_QUEUED` calls behind."""
        self.folded = 0
        """Steps folded into the one queued before them while the planner was behind."""
        self.errors = 0
        """Calls the planner failed on (logged); planning went on with the next."""

    @property
    def hello(self) -> Hello | None:
        """The hello the planner was opened with, as updated since (updates count once the planner took them in:
        after :meth:`flush`)."""
        return self._planner.hello or self._opened

    @property
    def session(self) -> PlannerSession | None:
        """The rank's planner, once open (read it after :meth:`flush`: the planner's thread changes it)."""
        return self._planner.session

    # -- the training thread's side -----------------------------------------

    def open(self, hello: Hello) -> None:
        self._opened = hello
        self._put(lambda: self._planner.open(hello))

    def update_hello(self, **fields: Any) -> None:
        def update() -> None:
            try:
                self._planner.update_hello(**fields)
            finally:
                if "budget_bytes" in fields:
                    self._on_budget_taken()

        self._put(update)

    def send_stats(self, step: StepRecord) -> None:
        # No lock and, while the planner polls, no wake-up: a deque's append is atomic, and waking a thread
        # costs the training thread tens of microseconds a step.
        if self._stopping:
            return
        if len(self._queue) >= MAX_QUEUED:
            self.dropped += 1
            return
        self._queue.append((None, step))
        # A new length needs its plan by the next step: the planner is woken for it, as when it sleeps.
        new_length = step.shape is not self._last_shape and step.shape != self._last_shape
        self._last_shape = step.shape
        if self._sleeping or new_length:
            with self._cond:
                self._cond.notify()

    def send_oom(self, oom: OomReport) -> None:
        self._put(lambda: self._planner.send_oom(oom))

    def plan_of(self, modes: tuple[Mode, ...], version: int, reason: str, shape: Shape | None = None) -> Plan | None:
        # Without the planner's lock, which a search holds for milliseconds: a price reads the profile (fixed)
        # and the session's static memory and target (each replaced whole), and the shared table of prepared
        # costs is guarded by its own lock.
        return self._planner.plan_of(modes, version, reason, shape)

    def flush(self, timeout: float) -> bool:
        """Wait until the planner has taken in every call so far, steady steps folded included (False after
        ``timeout``, or once closed)."""
        self._put(self._report_folded)
        with self._cond:
            done = self._cond.wait_for(lambda: self._stopping or (not self._queue and not self._busy), timeout)
            return done and not self._stopping

    def close(self, timeout: float) -> None:
        """Let the planner finish what it was handed (``timeout`` at most), then stop its thread."""
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._queue.clear()
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._planner.close(timeout)

    def _put(self, call: Callable[[], None]) -> None:
        """A call the planner must take (a hello, a budget, an out-of-memory error, a flush), woken for at once."""
        with self._cond:
            if self._stopping:
                return
            if len(self._queue) >= MAX_QUEUED:
                # It must reach the planner: a step's figures give way.
                self._queue.popleft()
                self.dropped += 1
            self._queue.append((call, None))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()
            self._cond.notify()

    # -- the planner's thread -------------------------------------------------

    def _delivered(self, plan: Plan) -> None:
        # A new plan: every step reported until it has held.
        self._planned = True
        self._steps_on_plan = 0
        self._interval = 0.0
        self._on_plan(plan)

    def _offer(self, stats: StepStats) -> None:
        """A step's statistics, folded with the steady steps before it while the planner allows it."""
        self._folder.interval = self._interval
        for report in self._folder.offer(stats, time.monotonic()):
            self._observe(report)

    def _report_folded(self) -> None:
        folded = self._folder.due(time.monotonic(), force=True)
        if folded is not None:
            self._observe(folded)

    def _observe(self, stats: StepStats) -> None:
        """A step's statistics to the planner; then how long steady steps may be folded from now on."""
        self._planned = False
        self._planner.send_stats(stats)
        if not self._planned:
            self._steps_on_plan += stats.steps
        session = self._planner.session
        self._interval = (
            report_interval(
                steps_on_plan=self._steps_on_plan,
                steady=session.steady,
                oom_risk=session.oom_risk,
                quiet_steps=QUIET_STEPS,
                max_interval_seconds=MAX_INTERVAL_S,
            )
            if session is not None
            else 0.0
        )

    def _folded(self, step: StepRecord) -> StepStats:
        """The statistics of ``step``, built here off the training thread; behind, with the steady steps queued
        after it folded in, so that the planner keeps pace (under the queue's lock)."""
        stats = step.stats()
        while self._queue and (later := self._queue[0][1]) is not None and steady(later.stats(), stats):
            self._queue.popleft()
            stats = fold(stats, later.stats())
            self.folded += 1
        return stats

    def _run(self) -> None:
        idle = 0.0
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while not self._stopping and not self._queue:
                    if idle >= IDLE_S:
                        self._sleeping = True
                        if not self._queue:  # looked at again: a step queued before the flag was up woke nobody
                            self._cond.wait()
                        self._sleeping = False
                    else:
                        # Steps' statistics come unannounced: looked for about once a step.
                        self._cond.wait(self._poll)
                        idle += self._poll
                if self._stopping:
                    return
                idle = 0.0
                call, step = self._queue.popleft()
                self._busy = True
                try:
                    stats = self._folded(step) if step is not None else None
                except Exception:
                    self.errors += 1
                    log.exception("rematd: a step's statistics could not be made; the plan in force stays")
                    continue
            try:
                with self._planning:
                    if call is not None:
                        call()
                    elif stats is not None:
                        self._offer(stats)
                        self._poll = min(MAX_POLL_S, max(MIN_POLL_S, stats.step_seconds))
            except Exception:
                self.errors += 1
                log.exception("rematd: the planner failed on a step; the plan in force stays")
