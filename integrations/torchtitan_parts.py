"""How rematd attaches to torchtitan's model parts (:mod:`rematd.integrations.torchtitan`): their layers found as
torchtitan's own checkpointing finds them, the handle's options and pins from the ``--activation-checkpoint.*``
flags, and one job name for every rank of a torchrun launch."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from rematd.client import Handle, OffloadConfig
from rematd.client.arguments import check_job

if TYPE_CHECKING:
    from rematd.integrations.torchtitan import RematdCheckpointing

log = logging.getLogger("rematd.torchtitan")

FLAG = "--activation-checkpoint"
"""The prefix of rematd's flags on torchtitan's command line."""


@dataclass(slots=True)
class Attached:
    """A handle and the model parts whose blocks it switches."""

    parts: list[nn.Module]
    handle: Handle
    logged: int = -1
    """The version of the last plan logged."""


def attach_options(c: RematdCheckpointing.Config) -> dict[str, Any]:
    """``attach``'s keyword arguments from rematd's flags."""
    return {
        "budget_bytes": c.budget_bytes,
        "margin_ratio": c.margin,
        "modes": c.modes,
        "server": c.server,
        "job": c.job or run_job(),
        "compress": c.compress,
        "offload": None if c.offload_prefetch is None else OffloadConfig(prefetch_blocks=c.offload_prefetch),
        "compile": c.compile,
    }


def pin_layers(handle: Handle, c: RematdCheckpointing.Config, keys: Sequence[str]) -> None:
    """Pin the modes ``--activation-checkpoint.pin`` gives the layers ``keys`` (if any); say what was attached."""
    if c.pin:
        handle.pin_modes(part_pins(c.pin, keys))
    log.info("rematd: attached to %d layers (%s)", len(keys), ", ".join(keys))


def run_job() -> str | None:
    """One job name for every rank of a torchrun launch: its run id (none outside torchrun, or when the run id is
    torchrun's placeholder)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    try:
        return None if run == "none" else check_job(f"torchtitan-{run}"[:128])
    except ValueError:
        return None


def find_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model part's transformer blocks by key, as torchtitan's own checkpointing finds them."""
    try:
        layers = model.get_submodule("layers")
    except AttributeError as err:
        raise ValueError(
            f"activation-checkpoint:rematd checkpoints a model's 'layers' (as torchtitan's own modes do); "
            f"{type(model).__name__} has none"
        ) from err
    return list(layers.named_children())


def part_pins(pin: Sequence[str], keys: Sequence[str]) -> list[str]:
    """The pins of one model part: one mode for every block, or each block's entry by its layer number."""
    if len(pin) == 1:
        return [pin[0]] * len(keys)
    out = []
    for key in keys:
        index = int(key) if key.isdigit() else -1
        if not 0 <= index < len(pin):
            raise ValueError(
                f"{FLAG}.pin has {len(pin)} modes, one per layer, and layer {key!r} has none: give one mode for "
                "every layer of the model, or a single mode"
            )
        out.append(pin[index])
    return out
