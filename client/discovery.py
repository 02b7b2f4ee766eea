"""Finding the repeated blocks of a model: the units a plan checkpoints.

A *block list* is an ``nn.ModuleList`` or ``nn.Sequential`` whose children
(one or more) all share one class. Lists of the same block class are one
group, wherever they sit: GPT-2's ``transformer.h``, Llama's
``model.layers``, ``nn.TransformerEncoder.layers``, and a ResNet's four
stages (``layer1`` .. ``layer4``, each a ``nn.Sequential`` of residual blocks
of a different width) all make one group; the blocks of a group are taken in
the model's module order, which is its execution order for these models.
Lists of bare containers (a ``stages`` list of ``nn.Sequential``) are looked
through. Lists nested inside a block of another list (a mixture of experts'
experts, the blocks inside a custom ``Stage`` class) are not candidates: their blocks do not all run on every forward.
Block classes with submodules are preferred over bare layers (a list of
``nn.Linear`` is a last resort). Groups of such classes (two or more blocks
each, or one block in a list named as one of theirs) are taken together when
each lives in a submodule of its own, none inside another's, whatever their
lengths: an encoder-decoder's
``encoder.layers`` and ``decoder.layers`` (BART, Whisper, Marian, and the
distilled ones with a shorter decoder) are all blocks, in module order (the
encoder's first, as they run). Otherwise the group with the most blocks wins;
groups that tie side by side in one module are ambiguous and must be chosen
with ``blocks=``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from rematd.client.parallel.pick import block_class


class BlockDiscoveryError(ValueError):
    """No usable set of blocks was found or given."""


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def _is_leaf(example: nn.Module) -> bool:
    return not any(True for _ in example.children())


@dataclass
class _Group:
    cls: type[nn.Module]
    lists: list[str] = field(default_factory=list)
    blocks: list[tuple[str, nn.Module]] = field(default_factory=list)

    def describe(self) -> str:
        where = ", ".join(name or "<root>" for name in self.lists)
        return f"{len(self.blocks)} x {self.cls.__name__} in {where}"

    def hint(self) -> str:
        if len(self.lists) == 1:
            return f"blocks=list(model.{self.lists[0]})" if self.lists[0] else "blocks=list(model)"
        return "blocks=[" + ", ".join(f"*model.{n}" for n in self.lists) + "]"


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _home(group: _Group) -> str:
    """The module holding all of a group's lists (the deepest common ancestor of their parents)."""
    parts = [_parent(n).split(".") if _parent(n) else [] for n in group.lists]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _apart(groups: list[_Group]) -> bool:
    """Whether each group sits in a submodule of its own, none inside another's (``encoder`` and ``decoder``)."""
    homes = [_home(g) for g in groups]
    for i, a in enumerate(homes):
        for j, b in enumerate(homes):
            if i != j and (a == b or a == "" or b.startswith(a + ".")):
                return False
    return True


def _stacks(rich: list[_Group], single: list[_Group]) -> list[_Group]:
    """The groups that may be stacks of one model: every group of two or more blocks, and a one-block group
    whose list is named as one of theirs (a one-layer ``decoder.layers`` beside ``encoder.layers``)."""
    names = {n.rpartition(".")[2] for g in rich for n in g.lists}
    return rich + [g for g in single if any(n.rpartition(".")[2] in names for n in g.lists)]


def _check_given(model: nn.Module, names: dict[int, str], chosen: list[nn.Module]) -> list[tuple[str, nn.Module]]:
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
    found = [(names[id(b)], b) for b in chosen]
    # A block inside another block would be checkpointed twice over.
    for name, _ in found:
        for other, _ in found:
            if other != name and name.startswith(other + "."):
                raise BlockDiscoveryError(f"blocks= names {name!r} inside {other!r}; give blocks that do not nest")
    return found


def find_blocks(
    model: nn.Module, blocks: Sequence[nn.Module] | None = None, *, lone: bool = False
) -> list[tuple[str, nn.Module]]:
    """The blocks to checkpoint, as (qualified name, module), in execution order.

    With ``blocks`` given, each must be a distinct submodule of ``model``, none
    inside another. Otherwise the largest group of same-class block lists
    (see the module's docstring); ``lone``: a list of one block will do (a
    pipeline stage may hold one layer).
    """
    names = _names(model)
    if blocks is not None:
        return _check_given(model, names, list(blocks))

    lists: list[tuple[str, list[tuple[str, nn.Module]], type[nn.Module]]] = []
    for name, module in model.named_modules():
        # A ModuleDict too: torchtitan keeps its layers in one, by layer id, and a pipeline stage deletes those
        # of the other stages.
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            children = list(module.named_children())
            classes = {block_class(child) for _, child in children}
            cls = classes.pop() if len(classes) == 1 else None
            # A list of plain containers (stages as nn.Sequential) is a way of grouping, not blocks.
            if cls is not None and cls not in (nn.Sequential, nn.ModuleList):
                lists.append((name, children, cls))
    block_names = {f"{n}.{k}" if n else k for n, m, _ in lists for k, _ in m}

    def nested(list_name: str) -> bool:
        parts = list_name.split(".")
        return any(".".join(parts[:k]) in block_names for k in range(1, len(parts)))

    groups: dict[type[nn.Module], _Group] = {}
    for name, module, cls in lists:
        if nested(name):
            continue
        g = groups.setdefault(cls, _Group(cls))
        g.lists.append(name)
        prefix = f"{name}." if name else ""
        g.blocks.extend((f"{prefix}{k}", child) for k, child in module)

    rich = [g for g in groups.values() if not _is_leaf(g.blocks[0][1]) and len(g.blocks) >= (1 if lone else 2)]
    bare = [g for g in groups.values() if _is_leaf(g.blocks[0][1]) and len(g.blocks) >= 2]
    pool = rich or bare
    if not pool:
        seen = "; ".join(g.describe() for g in groups.values()) or "no nn.ModuleList or nn.Sequential of one class"
        raise BlockDiscoveryError(
            f"found no list of two or more same-class blocks in {type(model).__name__} (saw: {seen}); "
            "pass the blocks to checkpoint explicitly, e.g. attach(model, blocks=list(model.layers))"
        )
    stacks = _stacks(rich, [g for g in groups.values() if not _is_leaf(g.blocks[0][1]) and len(g.blocks) == 1])
    if len(stacks) > 1 and _apart(stacks):
        # An encoder and a decoder, of any depths (distilbart's 12 and 6): every block of both, in module
        # order (the encoder's run first).
        order = {name: i for i, (name, _) in enumerate(model.named_modules())}
        return sorted((b for g in stacks for b in g.blocks), key=lambda b: order[b[0]])
    most = max(len(g.blocks) for g in pool)
    best = [g for g in pool if len(g.blocks) == most]
    if len(best) > 1:
        seen_desc = "; ".join(g.describe() for g in best)
        raise BlockDiscoveryError(
            f"several block lists are equally long: {seen_desc}; choose with blocks=, e.g. attach(model, "
            f"{best[0].hint()}), or both: blocks=[*a, *b] in execution order"
        )
    return best[0].blocks


def find_stage_blocks(
    model: nn.Module, roots: Sequence[nn.Module], blocks: Sequence[nn.Module] | None = None, *, stages: bool = False
) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model``; with ``stages``, of the pipeline stages a rank runs one after another (``roots``,
    held by ``model``), each found on its own (one block may do), named as in ``model``."""
    if blocks is not None or not stages:
        return find_blocks(model, blocks)
    names = _names(model)
    return [(names[id(m)], m) for root in roots for _, m in find_blocks(root, lone=True)]
