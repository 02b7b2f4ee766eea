"""rematd for the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[RematdTrainerCallback()])``."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from rematd.client import Handle, attach
from rematd.integrations.controls import HandleControls, PinArgument
from rematd.integrations.options import attach_options


class RematdTrainerCallback(HandleControls, TrainerCallback):  # type: ignore[misc]
    """Attaches rematd to the trainer's model when training begins, ends a rematd step after each optimizer step
    (so gradient-accumulation micro-batches share one plan) and closes the handle when training ends.

    The ``Trainer`` calls no callback when training fails, so the callback wraps the trainer's
    ``training_step`` (forward and backward, where an out-of-memory error or a bad batch raises) for the run:
    an error there closes the handle, restoring the model's own forwards, before it propagates. An error
    elsewhere in the loop (loading a batch, the optimizer step) leaves the handle open until the next
    ``train()`` or ``callback.handle.close()``.

    Keyword arguments are ``rematd.client.attach``'s (``server=``, ``job=``, ``budget_bytes=``, ``modes=``, ...),
    and ``pin_modes=`` (one mode for every block, or one per block) for modes fixed from the first step after
    profiling. ``callback.pin_modes(...)`` and ``callback.budget_bytes = ...`` change them while training runs
    (from another callback, say): they apply from the next optimizer step.
    The model must not have the Trainer's own checkpointing on (``activation_checkpointing``/
    ``gradient_checkpointing`` in ``TrainingArguments``): ``attach`` refuses it, saying so.
    """

    def __init__(self, *, pin_modes: PinArgument = None, **options: Any) -> None:
        self._options = attach_options(options, callback="RematdTrainerCallback")
        self.handle: Handle | None = None
        """The handle while training runs (and the last one after it ended)."""
        self._guarded: tuple[Trainer, Any] | None = None
        """The trainer whose ``training_step`` is wrapped, and the wrapper."""
        self.pin_modes(pin_modes)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise TypeError(f"RematdTrainerCallback needs the trainer's model, got {type(model).__name__}")
        if self.handle is not None:
            self.handle.close()  # a second train() on the same callback
        self._unguard()
        self.handle = attach(model, **self._options)
        self._controls_attached(self.handle)
        self._guard(_calling_trainer(), self.handle)

    def _guard(self, trainer: Trainer | None, handle: Handle) -> None:
        """Close ``handle`` when ``trainer.training_step`` raises (the Trainer has no callback for it)."""
        if trainer is None:
            return
        step = trainer.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return step(*args, **kwargs)
            except BaseException:
                handle.close()
                self._unguard()
                raise

        trainer.training_step = training_step  # type: ignore[method-assign]
        self._guarded = (trainer, training_step)

    def _unguard(self) -> None:
        if self._guarded is None:
            return
        trainer, wrapper = self._guarded
        self._guarded = None
        if trainer.__dict__.get("training_step") is wrapper:
            del trainer.__dict__["training_step"]

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.handle is not None:
            self.handle.step()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._unguard()
        if self.handle is not None:
            self.handle.close()


def _calling_trainer() -> Trainer | None:
    """The ``Trainer`` whose training loop is calling back (the callback is not handed it)."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None
