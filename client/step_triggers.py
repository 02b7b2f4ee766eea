"""What starts and ends a handle's steps: hooks on its roots' forward, the optimizer's or the sharded engine's
``step()``, and a schedule of stages' ``step()``; each set up here and removed together when the handle closes.

Also the checks of a schedule of stages: whether it runs the modules rematd is attached to, and finding the one
that runs them at the first step. Its errors name the handle's setting as the public API spells it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from rematd.client.attached_hooks import AttachedHook
from rematd.client.errors import UnsupportedModel
from rematd.client.parallel.pick import StepStart, follow_engine, read_schedule, running_schedule

log = logging.getLogger("rematd.client")


class StepTriggers:
    """The hooks a handle leaves on the user's model, optimizer, engine and schedule."""

    def __init__(
        self,
        roots: Sequence[nn.Module],
        pre_forward: Callable[..., Any],
        post_forward: Callable[..., Any],
        *,
        prepend: bool,
    ) -> None:
        """``pre_forward``/``post_forward`` on each root; ``prepend``: before the root's own pre-hooks."""
        self._hooks: list[RemovableHandle | StepStart] = []
        for root in roots:
            self._hooks += [
                root.register_forward_pre_hook(AttachedHook(pre_forward), with_kwargs=True, prepend=prepend),
                root.register_forward_hook(AttachedHook(post_forward), always_call=True),
            ]
        self._optimizer_hook: RemovableHandle | None = None
        self._unfollow: Callable[[], None] | None = None

    def follow_optimizer(self, optimizer: torch.optim.Optimizer | None, stepped: Callable[..., Any]) -> None:
        """``stepped`` after each ``optimizer.step()`` (None: after no optimizer's)."""
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if optimizer is not None:
            self._optimizer_hook = optimizer.register_step_post_hook(AttachedHook(stepped))

    def unfollow_engine(self) -> None:
        if self._unfollow is not None:
            self._unfollow()
            self._unfollow = None

    def follow_engine(self, engine: nn.Module, after: Callable[[], None]) -> None:
        """``after()`` after each of ``engine``'s steps that stepped the optimizer."""
        self._unfollow = follow_engine(engine, after)

    def follow_schedule(self, schedule: object, before: Callable[[tuple[Any, ...], dict[str, Any]], None]) -> None:
        """``before(args, kwargs)`` as each ``step()`` of ``schedule`` (of stages) starts."""
        self._hooks.append(StepStart(schedule, AttachedHook(before)))

    def remove(self) -> None:
        for h in (*self._hooks, *([self._optimizer_hook] if self._optimizer_hook else [])):
            h.remove()
        if self._unfollow is not None:
            self._unfollow()


def check_stages(read: Any, roots: Sequence[nn.Module]) -> None:
    """ValueError unless ``read``'s stages on this rank are the modules rematd is attached to (``roots``)."""
    modules = [s.module for s in read.stages]
    if len(modules) != len(roots) or any(a is not b for a, b in zip(modules, roots, strict=False)):
        raise ValueError(
            f"pipeline: the schedule runs {len(modules)} stage(s) on this rank "
            f"({', '.join(type(m).__name__ for m in modules)}), not the module rematd is attached to; attach to "
            "the schedule instead: client.attach(schedule)"
        )


def find_running_schedule(roots: Sequence[nn.Module]) -> Any:
    """At the first step of a handle attached to a module without a schedule: the schedule of stages whose
    ``step()`` runs the module (read, to be followed as if the handle had been given it, so that each stage is
    planned for the microbatches it holds at once), or None; a schedule rematd cannot follow stops the step with
    an error saying so."""
    schedule = running_schedule()
    if schedule is None:
        return None
    try:
        read = read_schedule(schedule)
        check_stages(read, roots)
    except ValueError as err:
        raise UnsupportedModel(
            f"{err} (a pipeline schedule runs the module rematd is attached to: set h.pipeline = schedule before "
            "the first step, or attach to the schedule)"
        ) from err
    log.info(
        "rematd: a pipeline schedule runs this module (%s); each stage is planned for the microbatches it "
        "holds at once (h.pipeline = schedule says so before the first step)",
        read.describe(),
    )
    return read
