"""Tensor parallel (``parallelize_module``), and what every set-up built on distributed tensors shares: the
device mesh whose ranks hold one model's parameters, and so must run one plan.

A tensor-parallel block's forward holds collectives (all-reduce, all-gather) and a recomputation replays them:
the ranks of its group must recompute the same blocks. The group is read from what the user built: the device
mesh of the parameters' distributed tensors (under FSDP2 over tensor parallel a 2-D mesh, data x tensor, and
the agreement reduces over each dimension's group; inside a pipeline stage, the stage's own mesh, which holds
no other stage). No process group is created.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from rematd.client.parallel.agreement import Agreement
from rematd.client.parallel.base import SetUp, imported


def dtensor() -> type | None:
    """torch's ``DTensor``, where a process made distributed tensors (see :func:`imported`)."""
    return imported("torch.distributed.tensor", "DTensor")


def has_dtensors(model: nn.Module) -> bool:
    """Whether parameters are distributed tensors (FSDP2 or tensor parallel): the ranks share the work."""
    cls = dtensor()
    return cls is not None and any(isinstance(p, cls) for p in model.parameters())


def _widest_mesh(model: nn.Module) -> Any:
    """The device mesh of the parameters that spans the most ranks (a 2-D mesh over a 1-D one: under FSDP2
    over tensor parallel the norms are sharded on the data dimension alone)."""
    best, cls = None, dtensor()
    for p in model.parameters():
        if cls is not None and isinstance(p, cls):
            mesh = p.device_mesh  # type: ignore[attr-defined]  # a DTensor's (its class looked up, not imported)
            if best is None or mesh.size() > best.size():
                best = mesh
    return best


def mesh_agreement(model: nn.Module) -> Agreement | None:
    """The ranks of the parameters' device mesh agreeing over each of its dimensions (None without a mesh of
    more than one rank)."""
    mesh = _widest_mesh(model)
    if mesh is None or mesh.size() < 2:
        return None
    names = mesh.mesh_dim_names or tuple(f"dim {d}" for d in range(mesh.ndim))
    dims = [d for d in range(mesh.ndim) if mesh.size(d) > 1]
    what = " x ".join(f"{names[d]} ({mesh.size(d)})" for d in dims)
    return Agreement([mesh.get_group(d) for d in dims], f"the device mesh {what}")


class TensorParallel(SetUp):
    """Parameters that are distributed tensors, not sharded by FSDP: the mesh's ranks run one plan."""

    name = "tensor parallel"

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.agreement = mesh_agreement(model)
