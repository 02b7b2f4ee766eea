"""Key/value caches under checkpointing: training forwards run without one, as Hugging Face's own checkpointing does.

A decoder layer appends its keys and values to the cache it is handed. A
checkpointed layer runs twice, in forward and again in backward, and would
append twice: the recompute then attends over twice the keys (a shape error
under eager attention, a mismatch of recorded ops under selective
checkpointing, or silently different numbers). So a forward rematd treats as
a training step (gradients enabled) gets ``use_cache=False`` at the outermost
module whose ``forward`` takes that argument, exactly as
``gradient_checkpointing_enable()`` does in ``transformers``; the change is
logged once. A forward under ``torch.no_grad()`` (generation, evaluation) is
left alone, with the cache as the user set it. A cache the caller passes in
explicitly is respected: the blocks that receive it keep their activations
for that forward (see :func:`holds_cache`), so it is updated exactly once.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from rematd.client.attached_hooks import AttachedHook

log = logging.getLogger("rematd.client")

# The names transformers gives the cache argument of a model and of its layers.
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def _cache_types() -> tuple[type, ...]:
    # Looked up only where transformers is already imported: rematd does not need it.
    module = sys.modules.get("transformers.cache_utils")
    cache = getattr(module, "Cache", None) if module is not None else None
    return (cache,) if isinstance(cache, type) else ()


def holds_cache(args: Iterable[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a block call is handed a key/value cache it would update (by name, or a ``transformers`` Cache)."""
    if any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS):
        return True
    types = _cache_types()
    return bool(types) and any(isinstance(a, types) for a in (*args, *kwargs.values()))


def _use_cache_position(module: nn.Module) -> int | None:
    """The positional index of ``use_cache`` in the module's forward, -1 if keyword-only, None if it has none."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "use_cache":
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            return i if positional else -1
    return None


def _default_use_cache(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return bool(getattr(config, "use_cache", False))


class _TrainingWithoutCache:
    """A forward pre-hook: ``use_cache=False`` for a forward with gradients and no cache of the caller's."""

    def __init__(self, name: str, position: int, logged: list[bool]) -> None:
        self.name = name
        self.position = position
        self.logged = logged

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not torch.is_grad_enabled() or holds_cache(args, kwargs):
            return None
        if 0 <= self.position < len(args):
            wanted = args[self.position]
            if wanted is False:
                return None
            args = (*args[: self.position], False, *args[self.position + 1 :])
        else:
            wanted = kwargs.get("use_cache")
            if wanted is False or (wanted is None and not _default_use_cache(module)):
                return None
            kwargs = {**kwargs, "use_cache": False}
        if not self.logged[0]:
            self.logged[0] = True
            log.warning(
                "rematd: training forwards of %s run with use_cache=False, as gradient_checkpointing_enable() "
                "does: a checkpointed block would update the key/value cache a second time when recomputed. "
                "Forwards under torch.no_grad() (generation, evaluation) keep the cache as configured.",
                self.name or type(module).__name__,
            )
        return args, kwargs


def train_without_cache(model: nn.Module) -> list[RemovableHandle]:
    """Hooks on the outermost modules of ``model`` whose forward takes ``use_cache``; remove them to undo."""
    handles: list[RemovableHandle] = []
    hooked: list[str] = []
    logged = [False]
    for name, module in model.named_modules():
        if any(name == h or name.startswith(h + ".") or h == "" for h in hooked):
            continue
        position = _use_cache_position(module)
        if position is None:
            continue
        hooked.append(name)
        hook: Callable[..., Any] = _TrainingWithoutCache(name or type(module).__name__, position, logged)
        handles.append(module.register_forward_pre_hook(AttachedHook(hook), with_kwargs=True))
    return handles
