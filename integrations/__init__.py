"""rematd in training frameworks: callbacks that attach, step and close, so that no loop needs writing.

- :class:`RematdTrainerCallback` for the Hugging Face ``Trainer``
  (``from rematd.integrations.huggingface import RematdTrainerCallback``);
- :class:`RematdCallback` for PyTorch Lightning's ``Trainer``
  (``from rematd.integrations.lightning import RematdCallback``).

Each is imported on first use: rematd needs neither ``transformers`` nor
``lightning`` unless its callback is asked for. torchtitan's trainer gets rematd
as one of its activation-checkpointing modes through
``python -m rematd.integrations.torchtitan`` (:mod:`rematd.integrations.torchtitan`).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"RematdTrainerCallback": "huggingface", "RematdCallback": "lightning"}

__all__ = ["RematdCallback", "RematdTrainerCallback"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
