"""The errors rematd's client raises to the training job."""

from __future__ import annotations

import torch


class OutOfMemory(torch.OutOfMemoryError):
    """A step crossed ``hard_limit_bytes`` of bytes saved for backward (rematd's CPU limit).

    A subclass of ``torch.OutOfMemoryError``, so code that handles CUDA's
    out-of-memory error handles this one alike.
    """


class UnsupportedModel(ValueError):
    """``attach`` was given a model wrapped in a way rematd cannot work with."""
