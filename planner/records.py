"""Frozen, slotted dataclasses built at the cost of a mutable one.

A frozen dataclass's generated ``__init__`` stores each field through ``object.__setattr__``, looked up and
dispatched again for every field: a step's statistics (25 fields) cost about 7 us to build that way, on the
training thread at every step. :func:`quick` gives such a class an ``__init__`` of the same signature, defaults
and ``__post_init__`` that stores each field through its slot's descriptor instead, about a third of the time.
Everything else (frozenness, equality, hashing, ``dataclasses.replace``) is the dataclass's own.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

T = TypeVar("T")


class _Factory:
    def __repr__(self) -> str:
        return "<factory>"  # as the dataclass's own signature shows it


_FACTORY = _Factory()
"""A field's default where it is built by its default factory."""


def quick(cls: type[T]) -> type[T]:
    """``cls`` (a frozen dataclass with slots) with an ``__init__`` that stores its fields through their slots."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: quick() takes a frozen dataclass with slots")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # checked above
    # Init-only variables are parameters of the dataclass's __init__ but no fields: not taken.
    taken = list(inspect.signature(cls.__init__).parameters)[1:]
    if taken != [f.name for f in fields if f.init and not f.kw_only] + [f.name for f in fields if f.init and f.kw_only]:
        raise TypeError(f"{cls.__name__}: quick() does not take init-only variables")
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for k, f in enumerate(fields):
        namespace[f"_set{k}"] = getattr(cls, f.name).__set__
        if f.default is not dataclasses.MISSING:
            namespace[f"_default{k}"] = f.default
            value, param = f"_default{k}", f"{f.name}=_default{k}"
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory{k}"] = f.default_factory
            value, param = f"_factory{k}()", f"{f.name}=_FACTORY"
        else:
            value, param = "", f.name
        if not f.init:
            body.append(f"    _set{k}(self, {value})")
            continue
        (keyword if f.kw_only else positional).append(param)
        if f.default_factory is not dataclasses.MISSING:
            body.append(f"    _set{k}(self, {value} if {f.name} is _FACTORY else {f.name})")
        else:
            body.append(f"    _set{k}(self, {f.name})")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    signature = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({signature}):\n" + "\n".join(body or ["    pass"]) + "\n"
    exec(source, namespace)  # the same way dataclasses writes the __init__ it replaces
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    type.__setattr__(cls, "__init__", init)
    return cls
