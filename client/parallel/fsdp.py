"""Sharded models (FSDP2's ``fully_shard``, with or without tensor parallel): what rematd must know of them.

A block's checkpoint region is its own ``forward``, which runs inside the
FSDP unit's hooks: the unit all-gathers its parameters before the forward
and, in backward, before the gradient reaches the block, so a recomputation
finds them gathered and gathers nothing again. That holds when each block is
an FSDP unit or lies inside one. A block that holds units of its own would
checkpoint around them (their all-gathers replayed in backward, FSDP's
prefetch order broken), and a block outside every unit of a sharded model
keeps parameters nobody shards: both are refused, naming the blocks.

FSDP's own memory enters the plan as two figures: the rank's shards
(parameters, gradients, optimizer state: memory that is there whatever the
plan) and the unsharded parameters held at the peak, the start of backward
(every unit kept unsharded after its forward, and the two resharded units in
flight: the one running and the one prefetched).

The figures are read from FSDP2's per-unit state (``_get_fsdp_state``), which
is private: where it cannot be read, the parameters' own sizes stand in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rematd.client.errors import UnsupportedModel
from rematd.client.memory.accounting import local_part, storage_id
from rematd.client.parallel.base import SetUp, imported
from rematd.client.parallel.tensor import mesh_agreement


def fsdp_module() -> type | None:
    """FSDP2's ``FSDPModule``, where a process sharded with it (see :func:`imported`)."""
    return imported("torch.distributed.fsdp", "FSDPModule")


log = logging.getLogger("rematd.client")


def is_unit(m: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``m`` (FSDP2 swaps its class for an ``FSDP<Class>`` subclass)."""
    cls = fsdp_module()
    return cls is not None and isinstance(m, cls)


def block_class(m: nn.Module) -> type[nn.Module]:
    """The class a block was defined with: for an FSDP unit, the class ``fully_shard`` derived its own from."""
    cls, unit = type(m), fsdp_module()
    if unit is None or not isinstance(m, unit):
        return cls
    for base in cls.__mro__[1:]:
        if issubclass(base, nn.Module) and not issubclass(base, unit):
            return base
    return cls


def refuse_fsdp1(model: nn.Module) -> None:
    """FSDP1 (``FullyShardedDataParallel``) flattens parameters and checkpoints its own way: refused."""
    for name, m in model.named_modules():
        if type(m).__name__ == "FullyShardedDataParallel":
            where = f" (at {name!r})" if name else ""
            raise UnsupportedModel(
                f"FullyShardedDataParallel{where} (FSDP1) is not supported: shard with FSDP2 instead, "
                "torch.distributed.fsdp.fully_shard on each block and then on the model, as torchtitan does. "
                "attach(model) before sharding, or after it: both work with fully_shard"
            )


def is_sharded(model: nn.Module) -> bool:
    """Whether any module of ``model`` is an FSDP2 unit."""
    return any(is_unit(m) for m in model.modules())


def check_units(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> None:
    """Raise :class:`UnsupportedModel` unless every block is an FSDP unit or lies inside one (sharded models)."""
    if not is_sharded(model):
        return
    inside_unit = _inside_units(model)
    around: list[str] = []
    outside: list[str] = []
    for name, block in blocks:
        if any(is_unit(m) for m in block.modules() if m is not block):
            around.append(name)
        elif not is_unit(block) and id(block) not in inside_unit:
            outside.append(name)
    if around:
        raise UnsupportedModel(
            f"blocks {_names(around)} hold FSDP units of their own: a checkpoint around a unit gathers its "
            "parameters again in backward and breaks FSDP's prefetch. Apply fully_shard to the blocks themselves "
            "(or to modules that hold whole blocks), not to modules inside them, or pass blocks= the units"
        )
    if outside:
        raise UnsupportedModel(
            f"blocks {_names(outside)} are not FSDP units and lie in none, while the model is sharded: call "
            "fully_shard on each block and then on the model (torchtitan's order), before the first step"
        )


def _inside_units(model: nn.Module) -> set[int]:
    """Ids of the modules that lie strictly inside some FSDP unit."""
    ids: set[int] = set()
    for m in model.modules():
        if is_unit(m):
            ids.update(id(sub) for sub in m.modules() if sub is not m)
    return ids


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


@dataclass(frozen=True, slots=True)
class UnitMemory:
    """One FSDP unit's parameters as FSDP holds them."""

    unsharded_bytes: int
    """Its own parameters gathered whole (in the parameter dtype of its mixed-precision policy)."""
    kept_after_forward_bytes: int
    """What stays gathered from its forward to its backward: all with ``reshard_after_forward=False``,
    a shard of the smaller group with an int, nothing when resharded."""


def _param_groups(unit: nn.Module) -> list[Any]:
    """The unit's parameter groups: one, or one per device mesh where ``shard_placement_fn`` gives parameters
    meshes of their own (torchtitan's experts under expert parallel), which the single-group accessor refuses."""
    state = unit._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group  # torch before per-parameter meshes: one group at most
    return [group] if group is not None else []


def _fsdp_params(unit: nn.Module) -> list[Any]:
    return [p for group in _param_groups(unit) for p in group.fsdp_params]


_UNREADABLE: set[str] = set()
"""The kinds of FSDP state already said to be unreadable: said once each, not at every step."""


def _unreadable(unit: nn.Module, err: Exception) -> None:
    """FSDP's private state of ``unit`` could not be read (a torch whose internals differ): the figures fall back
    to the parameters' own sizes, and the log says so once, as the CPU's count may then take gathered weights
    in as activations."""
    kind = f"{type(unit).__name__}: {type(err).__name__}"
    if kind in _UNREADABLE:
        return
    _UNREADABLE.add(kind)
    log.warning(
        "rematd: cannot read FSDP's parameter groups of a %s (%s: %s); on the CPU its gathered weights may be "
        "counted as activations",
        type(unit).__name__,
        type(err).__name__,
        err,
    )


def _group_memory(group: Any) -> UnitMemory:
    unsharded = 0
    for p in group.fsdp_params:
        dtype = getattr(p, "param_dtype", None) or p.orig_dtype
        unsharded += int(p._orig_size.numel()) * torch.empty((), dtype=dtype).element_size()
    if group.post_forward_mesh_info is None:
        return UnitMemory(unsharded, unsharded)
    if group.mesh_info == group.post_forward_mesh_info:
        return UnitMemory(unsharded, 0)
    size = int(group.post_forward_mesh_info.shard_mesh_size)
    return UnitMemory(unsharded, unsharded // max(1, size))


def unit_memory(unit: nn.Module) -> UnitMemory:
    """How much the unit's parameters take gathered, and how much of that stays gathered after its forward
    (each group of them as its own mesh reshards it)."""
    try:
        groups = [_group_memory(group) for group in _param_groups(unit)]
    except Exception as err:  # a torch whose private state differs: the parameters' global sizes stand in
        _unreadable(unit, err)
        total = sum(p.numel() * p.element_size() for p in _own_parameters(unit))
        return UnitMemory(int(total), 0)
    return UnitMemory(sum(g.unsharded_bytes for g in groups), sum(g.kept_after_forward_bytes for g in groups))


def _own_parameters(unit: nn.Module) -> Iterable[nn.Parameter]:
    """The unit's parameters that no unit inside it manages."""
    inner = {id(p) for m in unit.modules() if m is not unit and is_unit(m) for p in m.parameters()}
    return (p for p in unit.parameters() if id(p) not in inner)


def gathered_at_peak_bytes(model: nn.Module) -> int:
    """Unsharded parameter bytes FSDP holds when backward starts (a step's peak): each unit's kept part,
    and the two resharded units gathered then, the running one and the prefetched one."""
    units = [unit_memory(m) for m in model.modules() if is_unit(m)]
    kept = sum(u.kept_after_forward_bytes for u in units)
    regathered = sorted((u.unsharded_bytes - u.kept_after_forward_bytes for u in units), reverse=True)
    return kept + sum(regathered[:2])


def sharded_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The rank's parameters as FSDP keeps them sharded (between a unit's pre-forward and its reshard the
    module holds the gathered ones instead: the root's, at a step's first forward), and any parameter
    outside every unit as it is."""
    params: list[torch.Tensor] = []
    inside: set[int] = set()
    for m in model.modules():
        if not is_unit(m):
            continue
        try:
            params.extend(p.sharded_param for p in _fsdp_params(m))
        except Exception as err:
            _unreadable(m, err)
            continue  # counted below, as the module holds them
        inside.update(id(sub) for sub in m.modules())
    for m in model.modules():
        if id(m) not in inside:
            params.extend(m.parameters(recurse=False))
    return params


def _local_bytes(t: torch.Tensor) -> int:
    local = local_part(t)
    return int(local.numel() * local.element_size())


def shard_bytes(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> int:
    """This rank's shards: ``params``, their gradients and the optimizer's state (local bytes of DTensors)."""
    total = 0
    for p in params:
        total += _local_bytes(p)
        if p.grad is not None:
            total += _local_bytes(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    total += _local_bytes(v)
    return total


def gathered_storages(model: nn.Module) -> frozenset[int]:
    """Identities of the storages FSDP gathers parameters into, once it has gathered them (FSDP keeps them
    and resizes them in place), so that saved-tensor accounting does not count gathered weights as activations."""
    tensors: list[torch.Tensor] = []
    for m in model.modules():
        if not is_unit(m):
            continue
        try:
            params = _fsdp_params(m)
        except Exception as err:
            _unreadable(m, err)
            continue
        for p in params:
            tensors.extend(getattr(p, "all_gather_outputs", None) or ())
            unsharded = getattr(p, "_unsharded_param", None)
            if unsharded is not None:
                tensors.append(unsharded)
    return _storage_ids(tensors)


def parameter_storages(module: nn.Module) -> frozenset[int]:
    """Identities of the storages of ``module``'s parameters as they are now (inside an FSDP unit's forward:
    the gathered ones)."""
    return _storage_ids(module.parameters())


def _storage_ids(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    return frozenset(i for i in map(storage_id, tensors) if i is not None)


class Fsdp(SetUp):
    """A model sharded with FSDP2 as its steps see it: checked once its sharding is visible (at the first step,
    since ``attach`` may come before ``fully_shard``), then asked for FSDP's figures each step, from what was
    looked up once (the units, their sharded parameters) so that a step pays for sums, not searches. The ranks of
    the parameters' device mesh run one plan (with tensor parallel, over both of its dimensions): they share one
    memory shape, and one rank's out-of-memory error tightens them all."""

    name = "FSDP2"

    def __init__(self, model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], *, agree: bool = True) -> None:
        super().__init__()
        check_units(model, blocks)
        self.agreement = mesh_agreement(model) if agree else None
        self.model = model
        self._gathered_at_peak = gathered_at_peak_bytes(model)
        self._units = [m for m in model.modules() if is_unit(m)]
        self._storages: frozenset[int] = frozenset()
        self._params: list[torch.Tensor] | None = None
        self._param_bytes = 0
        self._state_key: tuple[int, int] = (0, -1)
        self._state_bytes = 0

    @property
    def gathered_at_peak(self) -> int:
        """Unsharded parameter bytes held at the step's peak (a constant of the model's sharding)."""
        return self._gathered_at_peak

    def static_bytes(self, optimizer: torch.optim.Optimizer | None, engine: nn.Module | None) -> int:
        # The CPU stands in for a device: the rank's shards are its static memory, as on CUDA, and so are the
        # parameters FSDP holds gathered at the peak (there at every moment of backward).
        return self.shard_bytes(optimizer) + self._gathered_at_peak

    def weight_storages(self) -> frozenset[int]:
        """FSDP's gathering storages; they appear at each unit's first all-gather and then stay."""
        if len(self._storages) < len(self._units):
            self._storages = gathered_storages(self.model)
        return self._storages

    def block_weights(self, module: nn.Module) -> frozenset[int]:
        return parameter_storages(module)

    def shard_bytes(self, optimizer: torch.optim.Optimizer | None) -> int:
        if self._params is None:
            self._params = sharded_parameters(self.model)
            self._param_bytes = sum(_local_bytes(p) for p in self._params)
        grads = sum(_local_bytes(p.grad) for p in self._params if p.grad is not None)
        # An optimizer makes its state once per parameter and keeps its size: counted again only when it grows.
        states = len(optimizer.state) if optimizer is not None else 0
        if (id(optimizer), states) != self._state_key:
            self._state_key, self._state_bytes = (id(optimizer), states), shard_bytes((), optimizer)
        return self._param_bytes + grads + self._state_bytes
