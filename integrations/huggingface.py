"""rematd for the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[RematdTrainerCallback()])``."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from rematd.client import Handle, attach
from rematd.integrations.options import attach_options


class RematdTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """Attaches rematd to the trainer's model when training begins, ends a rematd step after each optimizer step
    (so gradient-accumulation micro-batches share one plan) and closes the handle when training ends.

    Keyword arguments are ``rematd.client.attach``'s (``server=``, ``job=``, ``budget_bytes=``, ``modes=``, ...).
    The model must not have the Trainer's own checkpointing on (``activation_checkpointing``/
    ``gradient_checkpointing`` in ``TrainingArguments``): ``attach`` refuses it, saying so.
    """

    def __init__(self, **options: Any) -> None:
        self._options = attach_options(options, callback="RematdTrainerCallback")
        self.handle: Handle | None = None
        """The handle while training runs (and the last one after it ended)."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise TypeError(f"RematdTrainerCallback needs the trainer's model, got {type(model).__name__}")
        if self.handle is not None:
            self.handle.close()  # a second train() on the same callback
        self.handle = attach(model, **self._options)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.handle is not None:
            self.handle.step()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.handle is not None:
            self.handle.close()
