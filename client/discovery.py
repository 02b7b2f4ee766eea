"""Finding the repeated blocks of a model: the units a plan checkpoints."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class BlockDiscoveryError(ValueError):
    """No usable set of blocks was found or given."""


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def find_blocks(model: nn.Module, blocks: Sequence[nn.Module] | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks to checkpoint, as (qualified name, module), in execution order.

    With ``blocks`` given, each must be a distinct submodule of ``model``.
    Otherwise the longest ``nn.ModuleList`` whose children share one class.
    """
    names = _names(model)
    if blocks is not None:
        chosen = list(blocks)
        if not chosen:
            raise BlockDiscoveryError("blocks= is empty; pass the modules to checkpoint, e.g. blocks=model.layers")
        seen: set[int] = set()
        for i, block in enumerate(chosen):
            if not isinstance(block, nn.Module):
                raise BlockDiscoveryError(f"blocks[{i}] is a {type(block).__name__}, not an nn.Module")
            if id(block) not in names or block is model:
                raise BlockDiscoveryError(f"blocks[{i}] ({type(block).__name__}) is not a submodule of the model")
            if id(block) in seen:
                raise BlockDiscoveryError(f"blocks[{i}] ({names[id(block)]}) is given twice")
            seen.add(id(block))
        return [(names[id(b)], b) for b in chosen]

    candidates: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            classes = {type(child) for child in module}
            if len(classes) == 1:
                candidates.append((name, module))
    if not candidates:
        raise BlockDiscoveryError(
            f"found no nn.ModuleList of two or more modules of one class in {type(model).__name__}; "
            "pass the blocks to checkpoint explicitly, e.g. attach(model, blocks=list(model.layers))"
        )
    longest = max(len(m) for _, m in candidates)
    best = [(n, m) for n, m in candidates if len(m) == longest]
    if len(best) > 1:
        seen_desc = ", ".join(f"{n or '<root>'} ({len(m)} x {type(m[0]).__name__})" for n, m in best)
        raise BlockDiscoveryError(
            f"several block lists are equally long: {seen_desc}; choose one with blocks=, "
            f"e.g. attach(model, blocks=list(model.{best[0][0]}))"
        )
    name, module_list = best[0]
    prefix = f"{name}." if name else ""
    return [(f"{prefix}{i}", child) for i, child in enumerate(module_list)]
