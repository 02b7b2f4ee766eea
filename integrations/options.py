"""The ``attach`` keywords a callback passes on, checked when the callback is made."""

from __future__ import annotations

import inspect
from typing import Any

from rematd.client import attach

# The callback owns these: the model is the trainer's, and the callback ends each step itself.
_OWNED = ("model", "optimizer")


def attach_options(options: dict[str, Any], *, callback: str) -> dict[str, Any]:
    """``options`` if ``attach`` accepts each of them; ``TypeError`` naming the first it does not."""
    accepted = [p for p in inspect.signature(attach).parameters if p not in _OWNED]
    for key in options:
        if key in _OWNED:
            raise TypeError(f"{callback} sets attach's {key}= itself; leave it out")
        if key not in accepted:
            raise TypeError(f"{callback} got an unknown attach option {key!r}; accepted: {', '.join(accepted)}")
    return dict(options)
