"""Command-line flags built from settings dataclasses: one flag per field, so a new setting is one edit.

A field's flag is its name with dashes (``keep_steps``: ``--keep-steps``); its type comes from the annotation,
its default from the field, its help from the attribute docstring under it. A field whose type is itself a
dataclass contributes its own fields' flags. A field with ``NO_FLAG`` metadata has none.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

from rematd.server.config import NO_FLAG

_TYPES: dict[Any, type] = {str: str, int: int, float: float, bool: bool}


@dataclass(frozen=True, slots=True)
class Flag:
    """One setting's flag."""

    path: tuple[str, ...]
    """Field names from the top dataclass to the setting (``("store", "keep_steps")``)."""
    type: type
    default: Any
    help: str

    @property
    def name(self) -> str:
        return "--" + self.path[-1].replace("_", "-")

    @property
    def dest(self) -> str:
        return ".".join(self.path)


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of ``cls``, joined into one line."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"setting {f.name} has no default, so it cannot be an optional flag")


def flags_of(cls: type, prefix: tuple[str, ...] = ()) -> list[Flag]:
    """Every flag of the settings dataclass ``cls``, its nested dataclasses' included."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    out: list[Flag] = []
    for f in dataclasses.fields(cls):
        if NO_FLAG in f.metadata:
            continue
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            out.extend(flags_of(kind, (*prefix, f.name)))
            continue
        if kind not in _TYPES:
            raise TypeError(f"setting {cls.__name__}.{f.name}: no flag for a {kind}; mark it NO_FLAG or give it one")
        out.append(Flag(path=(*prefix, f.name), type=_TYPES[kind], default=_default(f), help=docs.get(f.name, "")))
    names = [flag.name for flag in out]
    if len(set(names)) != len(names):
        raise TypeError(f"two settings of {cls.__name__} would share a flag: {sorted(names)}")
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type) -> list[Flag]:
    """Add ``cls``'s flags to ``parser``; what :func:`build` takes back."""
    flags = flags_of(cls)
    for flag in flags:
        text = flag.help.replace("%", "%%")
        if flag.type is bool:
            action = parser.add_argument(
                flag.name, dest=flag.dest, action=argparse.BooleanOptionalAction, default=flag.default, help=text
            )
        else:
            action = parser.add_argument(
                flag.name,
                dest=flag.dest,
                type=flag.type,
                default=flag.default,
                metavar=flag.path[-1].upper(),
                help=text,
            )
        # Some Python versions add it themselves to a boolean flag's help.
        if flag.default not in ("", None) and "%(default)" not in (action.help or ""):
            action.help = f"{action.help} (default: %(default)s)"
    return flags


def build(cls: type[Any], args: argparse.Namespace, flags: list[Flag], /, **fixed: Any) -> Any:
    """An instance of ``cls`` from parsed ``flags``; ``fixed`` gives settings that have no flag."""
    values: dict[tuple[str, ...], Any] = {flag.path: getattr(args, flag.dest) for flag in flags}
    return _build(cls, (), values, fixed)


def _build(cls: type[Any], prefix: tuple[str, ...], values: dict[tuple[str, ...], Any], fixed: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = dict(fixed)
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        kind = hints[f.name]
        if path in values:
            kwargs[f.name] = values[path]
        elif dataclasses.is_dataclass(kind) and isinstance(kind, type) and NO_FLAG not in f.metadata:
            kwargs[f.name] = _build(kind, path, values, {})
    return cls(**kwargs)
