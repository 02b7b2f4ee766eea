"""rematd for PyTorch Lightning: ``lightning.Trainer(..., callbacks=[RematdCallback()])``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch.utils.hooks import RemovableHandle

from rematd.client import Handle, attach, find_blocks
from rematd.client.attached_hooks import AttachedHook
from rematd.integrations.controls import HandleControls, PinArgument
from rematd.integrations.options import attach_options


class RematdCallback(HandleControls, pl.Callback):
    """Attaches rematd to the ``LightningModule`` when training starts (after the sanity check), ends a rematd
    step after each optimizer step (every optimizer of the module's; gradient-accumulation micro-batches share
    one plan), and closes the handle when training ends or fails.

    A ``training_step`` seldom calls the ``LightningModule`` itself: it calls the network it holds
    (``self.model(...)``). rematd is attached to the module a step calls, which begins each of its steps:
    ``attach_to`` names it (an attribute path, e.g. ``"model"``; ``""`` for the LightningModule itself);
    by default, the LightningModule's child that holds every block, or the LightningModule when the
    blocks span several children.

    ``pin_modes=`` fixes modes (one for every block, or one per block) from the first step after profiling;
    ``callback.pin_modes(...)`` and ``callback.budget_bytes = ...`` change them while training runs (from
    ``training_step`` or another callback): they apply from the next optimizer step. Other keyword arguments
    are ``rematd.client.attach``'s (``server=``, ``job=``, ``budget_bytes=``, ``blocks=``, ...).
    """

    def __init__(self, *, attach_to: str | None = None, pin_modes: PinArgument = None, **options: Any) -> None:
        if attach_to is not None and not isinstance(attach_to, str):
            raise TypeError(f"attach_to must be an attribute path such as 'model', got {type(attach_to).__name__}")
        self._attach_to = attach_to
        self._options = attach_options(options, callback="RematdCallback")
        self.handle: Handle | None = None
        """The handle while training runs (and the last one after it ended)."""
        self._hooks: list[RemovableHandle] = []
        self.pin_modes(pin_modes)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()
        handle = attach(self._target(pl_module), **self._options)
        self.handle = handle
        self._controls_attached(handle)
        for optimizer in trainer.optimizers:
            self._hooks.append(optimizer.register_step_post_hook(AttachedHook(lambda *_: handle.step())))

    def _target(self, pl_module: pl.LightningModule) -> nn.Module:
        if self._attach_to is not None:
            target = pl_module.get_submodule(self._attach_to)  # raises AttributeError naming what is missing
            return target
        names = [name for name, _ in find_blocks(pl_module, self._options.get("blocks"))]
        children = {name.split(".", 1)[0] for name in names}
        if len(children) == 1 and all("." in name for name in names):
            child: nn.Module = pl_module.get_submodule(children.pop())
            return child
        return pl_module

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.handle is not None:
            self.handle.close()
