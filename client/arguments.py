"""Checks of ``attach``'s arguments: a bad one fails at once, naming itself and what is accepted.

Anything caught later would surface on the stream thread or the service,
far from the call that caused it, or not at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

import torch

from rematd.planner import MODE_LETTERS, MODES_BY_LABEL, MODES_BY_LETTER, Mode
from rematd.planner.messages import JOB_ID_RE

ACCEPTED_MODES = ", ".join(repr(n) for n in MODES_BY_LABEL)

# What the wire's integer fields (and the service's records) carry.
MAX_BYTES = 2**63 - 1

# Targets gRPC resolves by scheme; anything else must be host:port.
GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")


def check_job(job: object) -> str | None:
    """The job name as the service accepts it (the same rule as its check of a hello)."""
    if job is None:
        return None
    if not isinstance(job, str):
        raise TypeError(f"job must be a string, got {type(job).__name__}")
    if not JOB_ID_RE.match(job):
        raise ValueError(
            f"job must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit; got {job!r}"
        )
    return job


def check_server(server: object) -> str | None:
    """``host:port``, ``[v6addr]:port`` or a gRPC target with a scheme (``dns:///host:port``, ``unix:path``)."""
    if server is None:
        return None
    if not isinstance(server, str):
        raise TypeError(f"server must be a 'host:port' string, got {type(server).__name__}")
    accepted = "'host:port' (e.g. 'localhost:50051'), '[::1]:50051' or a gRPC target such as 'dns:///host:port'"
    if not server or any(c.isspace() for c in server):
        raise ValueError(f"server must be {accepted}; got {server!r}")
    if server.startswith(GRPC_SCHEMES):
        return server
    host, sep, port = server.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if (
        not sep
        or not host
        or (":" in host and not bracketed)
        or not port.isdigit()
        or not 0 < int(port) < 65536
        or (bracketed and len(host) == 2)
    ):
        raise ValueError(f"server must be {accepted}; got {server!r}")
    return server


def check_bytes(name: str, value: object, *, optional: bool = True) -> int | None:
    """A positive whole number of bytes (an int, or a float such as ``2e9``)."""
    if value is None and optional:
        return None
    wanted = f"{name} must be a positive number of bytes" + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{wanted}, got {type(value).__name__} {value!r}")
    if isinstance(value, Integral):
        n = int(value)
    else:
        f = float(value)
        if not math.isfinite(f) or not f.is_integer():
            raise ValueError(f"{wanted} (a whole number), got {value!r}")
        n = int(f)
    if not 0 < n <= MAX_BYTES:
        raise ValueError(f"{wanted} up to 2**63-1, got {value!r}")
    return n


def check_hard_limit(value: Any) -> int | None:
    """A new ``hard_limit_bytes`` (``None``: no limit)."""
    if value is not None and (isinstance(value, bool) or int(value) <= 0):
        raise ValueError(f"hard_limit_bytes must be a positive number of bytes or None, got {value!r}")
    return None if value is None else int(value)


def check_margin(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"margin_ratio must be a number in [0, 1), got {type(value).__name__} {value!r}")
    margin = float(value)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin_ratio must be in [0, 1) (the fraction of the budget kept free), got {value!r}")
    return margin


def check_optimizer(optimizer: object) -> torch.optim.Optimizer | None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer (its step runs h.step()) or None, got {type(optimizer).__name__}"
    )


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_optional_flag(name: str, value: object) -> bool | None:
    if value is None:
        return None
    return check_flag(f"{name} (or None)", value)


def mode_of(name: str, value: Any) -> Mode:
    """A mode from its name (any case) or a :class:`Mode` value."""
    if isinstance(value, Mode):
        return value
    if isinstance(value, str) and value.lower() in MODES_BY_LABEL:
        return MODES_BY_LABEL[value.lower()]
    raise ValueError(f"{name}: unknown mode {value!r}; accepted: {ACCEPTED_MODES} or rematd.planner.Mode values")


def mode_sequence(name: str, values: object) -> list[Mode]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name} must be a list of modes ({ACCEPTED_MODES} or rematd.planner.Mode values), "
            f"got {type(values).__name__} {values!r}"
        )
    return [mode_of(name, v) for v in values]


def pin_sequence(values: object, blocks: int) -> list[Mode]:
    """``pin_modes``' argument: one mode for every block (a name or a :class:`Mode`), one per block, or a plan
    as plans are printed, one letter a block (``"RRR.aa"``)."""
    if isinstance(values, str) and values.lower() not in MODES_BY_LABEL:
        if not set(values) <= set(MODES_BY_LETTER):
            raise ValueError(
                f"pin_modes: unknown mode {values!r}; accepted: {ACCEPTED_MODES} or rematd.planner.Mode values, "
                f"or one letter a block of {''.join(MODE_LETTERS.values())!r}"
            )
        if len(values) != blocks:
            raise ValueError(f"pin_modes: {values!r} has {len(values)} letters, one per block; the model has {blocks}")
        return [MODES_BY_LETTER[c] for c in values]
    if isinstance(values, (str, Mode)):
        return [mode_of("pin_modes", values)] * blocks
    if isinstance(values, bytes) or not isinstance(values, Sequence):
        raise TypeError(
            f"pin_modes takes a mode for every block or a list of modes, one per block ({ACCEPTED_MODES} "
            f"or rematd.planner.Mode values), got {type(values).__name__} {values!r}"
        )
    return mode_sequence("pin_modes", values)


DEFAULT_MODES = frozenset({Mode.STORE, Mode.SELECTIVE, Mode.TITAN, Mode.ATTENTION, Mode.MLP, Mode.RECOMPUTE})
"""Offload is opt-in: measured on a GPU, it has not beaten recomputing the same blocks. Compress is
opt-in: it is lossy. The attention and MLP modes are offered by the blocks whose parts are found."""


def parse_modes(names: object) -> frozenset[Mode]:
    """The modes a plan may use (default :data:`DEFAULT_MODES`); STORE is always allowed."""
    if names is None:
        return DEFAULT_MODES
    return frozenset({Mode.STORE, *mode_sequence("modes", names)})


def check_compile(value: object) -> str | None:
    """``compile``: False (eager), True (Inductor) or the name of a ``torch.compile`` backend."""
    if value is None or value is False:
        return None
    if value is True or (isinstance(value, str) and value):
        from rematd.client.blocks.compiled import check_torch_version

        check_torch_version(torch.__version__)
    if value is True:
        return "inductor"
    accepted = "True, False or a torch.compile backend's name"
    if isinstance(value, str) and value:
        from torch import _dynamo

        known = _dynamo.list_backends(exclude_tags=())
        if value not in known:
            raise ValueError(f"compile must be {accepted} (one of {', '.join(sorted(known))}); got {value!r}")
        return value
    raise TypeError(f"compile must be {accepted}, got {type(value).__name__} {value!r}")
