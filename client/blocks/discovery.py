"""Finding the repeated blocks of a model: the units a plan checkpoints.

A *block list* is an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``
(torchtitan keeps its layers in one, keyed ``"0"``, ``"1"``, ...) whose children
(one or more) all share one class. Lists of the same block class are one
group, wherever they sit: GPT-2's ``transformer.h``, Llama's
``model.layers``, ``nn.TransformerEncoder.layers``, and a ResNet's four
stages (``layer1`` .. ``layer4``, each a ``nn.Sequential`` of residual blocks
of a different width) all make one group; the blocks of a group are taken in
the model's module order, which is its execution order for these models.
Children that are plain containers are blocks when they are alike (the same
submodules, parameters of the same shapes: a ``ModuleList`` of
``nn.Sequential(Linear, GELU, Linear)``); a list of containers that hold
block lists themselves (a ``stages`` list of ``nn.Sequential`` of residual
blocks) is looked through. Lists nested inside a block of another list (a mixture of experts'
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

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from rematd.client.parallel.pick import block_class

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
"""The modules that hold blocks: their children are the candidates."""

Key = type[nn.Module] | tuple[type[nn.Module], tuple[object, ...]]
"""What makes blocks one group: their class, and for plain containers their layout too."""


class BlockDiscoveryError(ValueError):
    """No usable set of blocks was found or given."""


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def _is_leaf(example: nn.Module) -> bool:
    return not any(True for _ in example.children())


def _elements(name: str, module: nn.Module) -> str:
    """How to write a container's elements as a list: a ModuleDict's are its values, not its keys."""
    where = f"model.{name}" if name else "model"
    return f"{where}.values()" if isinstance(module, nn.ModuleDict) else where


def _layout(module: nn.Module) -> tuple[object, ...]:
    """A container block's layout: its submodules' classes and its parameters' shapes, in order."""
    classes = tuple((n, block_class(m).__name__) for n, m in module.named_modules())
    return classes, tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def _label(module: nn.Module) -> str:
    cls = block_class(module).__name__
    if not isinstance(module, CONTAINERS):
        return cls
    return f"{cls}({', '.join(block_class(c).__name__ for c in module.children())})"


@dataclass
class _Group:
    label: str
    lists: list[str] = field(default_factory=list)
    exprs: list[str] = field(default_factory=list)
    """Each list's elements as Python (``model.layers``, ``model.layers.values()``)."""
    blocks: list[tuple[str, nn.Module]] = field(default_factory=list)

    def describe(self) -> str:
        where = ", ".join(name or "<root>" for name in self.lists)
        return f"{len(self.blocks)} x {self.label} in {where}"

    def hint(self) -> str:
        if len(self.exprs) == 1:
            return f"blocks=list({self.exprs[0]})"
        return "blocks=[" + ", ".join(f"*{e}" for e in self.exprs) + "]"


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


def _given(model: nn.Module, blocks: Sequence[nn.Module] | nn.ModuleDict) -> list[nn.Module]:
    """``blocks=`` as a list of modules: a ModuleDict's values (its iteration gives its keys)."""
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    chosen = list(blocks)
    if chosen and all(isinstance(b, str) for b in chosen):
        dicts = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleDict) and set(m.keys()) >= set(chosen)]
        if dicts:
            raise BlockDiscoveryError(
                f"blocks= holds the keys of the nn.ModuleDict model.{dicts[0]}, not its modules; pass "
                f"blocks=list({_elements(dicts[0], model.get_submodule(dicts[0]))})"
            )
    return chosen


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


def _holds_blocks(container: nn.Module) -> bool:
    """Whether a container is a list of blocks of its own (a stage of residual blocks), to be looked through."""
    children = list(container.children())
    classes = {block_class(c) for c in children}
    return len(classes) == 1 and not issubclass(next(iter(classes)), CONTAINERS) and not _is_leaf(children[0])


def _key(children: list[nn.Module]) -> Key | None:
    """The group a container's children make as blocks; None when they are not blocks of one kind."""
    classes = {block_class(child) for child in children}
    if len(classes) != 1:
        return None
    cls = classes.pop()
    if not issubclass(cls, CONTAINERS):
        return cls
    # Plain containers: stages holding block lists are looked through; alike ones are blocks themselves.
    if any(_holds_blocks(c) for c in children):
        return None
    layouts = {_layout(c) for c in children}
    return (cls, layouts.pop()) if len(layouts) == 1 else None


def _groups(model: nn.Module) -> dict[Key, _Group]:
    lists: list[tuple[str, nn.Module, list[tuple[str, nn.Module]], Key]] = []
    for name, module in model.named_modules():
        if isinstance(module, CONTAINERS):
            children = list(module.named_children())
            key = _key([c for _, c in children]) if children else None
            if key is not None:
                lists.append((name, module, children, key))
    block_names = {f"{n}.{k}" if n else k for n, _, children, _ in lists for k, _ in children}

    def nested(list_name: str) -> bool:
        # Inside a block of another list, or a block itself (a container block is a list of its layers).
        parts = list_name.split(".")
        return any(".".join(parts[:k]) in block_names for k in range(1, len(parts) + 1))

    groups: dict[Key, _Group] = {}
    for name, module, children, key in lists:
        if nested(name):
            continue
        g = groups.setdefault(key, _Group(_label(children[0][1])))
        g.lists.append(name)
        g.exprs.append(_elements(name, module))
        prefix = f"{name}." if name else ""
        g.blocks.extend((f"{prefix}{k}", child) for k, child in children)
    return groups


def _containers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """The model's non-empty containers, outermost first (then most children first), each with what it holds,
    for an error that says what discovery saw."""
    seen = []
    for name, module in model.named_modules():
        if isinstance(module, CONTAINERS) and any(True for _ in module.children()):
            counts = Counter(_label(c) for c in module.children())
            held = ", ".join(f"{n} x {label}" for label, n in counts.most_common())
            children = list(module.children())
            if len(counts) == 1 and isinstance(children[0], CONTAINERS) and len({_layout(c) for c in children}) > 1:
                held += ", unlike in their layers' shapes"
            seen.append((sum(counts.values()), name, module, f"{name or '<root>'} ({type(module).__name__} of {held})"))
    seen.sort(key=lambda s: (s[1].count(".") + bool(s[1]), -s[0]))
    return [(name, module, said) for _, name, module, said in seen]


def _nothing_found(model: nn.Module, groups: dict[Key, _Group]) -> BlockDiscoveryError:
    containers = _containers(model)
    if not containers:
        return BlockDiscoveryError(
            f"found no list of two or more same-class blocks in {type(model).__name__} (saw: no nn.ModuleList, "
            "nn.Sequential or nn.ModuleDict with children); pass the blocks to checkpoint explicitly, "
            "e.g. attach(model, blocks=[model.block_a, model.block_b])"
        )
    seen = [g.describe() for g in groups.values()] or [said for _, _, said in containers[:4]]
    name, module, _ = containers[0]
    return BlockDiscoveryError(
        f"found no list of two or more same-class blocks in {type(model).__name__} (saw: {'; '.join(seen)}); "
        f"pass the blocks to checkpoint explicitly, e.g. attach(model, blocks=list({_elements(name, module)}))"
    )


def find_blocks(
    model: nn.Module, blocks: Sequence[nn.Module] | nn.ModuleDict | None = None, *, lone: bool = False
) -> list[tuple[str, nn.Module]]:
    """The blocks to checkpoint, as (qualified name, module), in execution order.

    With ``blocks`` given (modules, or an ``nn.ModuleDict`` whose values are the blocks), each must be a
    distinct submodule of ``model``, none inside another. Otherwise the largest group of same-class block
    lists (see the module's docstring); ``lone``: a list of one block will do (a stage may hold one
    layer).
    """
    names = _names(model)
    if blocks is not None:
        return _check_given(model, names, _given(model, blocks))

    groups = _groups(model)
    rich = [g for g in groups.values() if not _is_leaf(g.blocks[0][1]) and len(g.blocks) >= (1 if lone else 2)]
    bare = [g for g in groups.values() if _is_leaf(g.blocks[0][1]) and len(g.blocks) >= 2]
    pool = rich or bare
    if not pool:
        raise _nothing_found(model, groups)
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
    model: nn.Module,
    roots: Sequence[nn.Module],
    blocks: Sequence[nn.Module] | nn.ModuleDict | None = None,
    *,
    stages: bool = False,
) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model``; with ``stages``, of the stages a rank runs one after another (``roots``,
    held by ``model``), each found on its own (one block may do), named as in ``model``."""
    if blocks is not None or not stages:
        return find_blocks(model, blocks)
    names = _names(model)
    return [(names[id(m)], m) for root in roots for _, m in find_blocks(root, lone=True)]


def model_fingerprint(blocks: Sequence[tuple[str, nn.Module]]) -> str:
    """A short hash of the blocks' names, classes and parameter shapes: the same model gets the same one."""
    h = hashlib.sha256()
    for name, module in blocks:
        h.update(f"{name}:{type(module).__qualname__}".encode())
        for pname, p in module.named_parameters():
            h.update(f"{pname}{tuple(p.shape)}{p.dtype}".encode())
    return h.hexdigest()[:16]
