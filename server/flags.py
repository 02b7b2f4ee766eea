"""``rematd serve``'s options, one per setting of the config dataclasses, parsed by pydantic-settings from the
command line and from ``REMATD_*`` environment variables (the command line wins over the environment).

A setting's flag is its name with dashes (``keep_steps``: ``--keep-steps``), its variable its name in capitals
(``REMATD_KEEP_STEPS``); its type comes from the annotation, its default from the field, its help from the
attribute docstring under it. A field whose type is itself a dataclass contributes its own fields. A field with
``NO_FLAG`` metadata has neither.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import textwrap
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, SettingsConfigDict

from rematd.server.config import NO_FLAG

ENV_PREFIX = "REMATD_"
_TYPES = (str, int, float, bool)


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting that has a flag and a variable."""

    path: tuple[str, ...]
    """Field names from the top dataclass to the setting (``("store", "keep_steps")``)."""
    kind: type
    default: object
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.path[-1].replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.path[-1].upper()


class BadOption(ValueError):
    """An option's value was refused; the message names the flag or the variable it came from."""


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of ``cls``, joined into one line."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    return {
        stmt.target.id: " ".join(after.value.value.split())
        for stmt, after in zip(node.body, node.body[1:], strict=False)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
    }  # fmt: skip


def settings_of(cls: type, prefix: tuple[str, ...] = ()) -> list[Setting]:
    """Every setting of the config dataclass ``cls`` that has a flag, its nested dataclasses' included."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if NO_FLAG in f.metadata:
            continue
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            out.extend(settings_of(kind, (*prefix, f.name)))
        elif kind in _TYPES and f.default is not dataclasses.MISSING:
            out.append(Setting(path=(*prefix, f.name), kind=kind, default=f.default, help=docs.get(f.name, "")))
        else:
            raise TypeError(f"setting {cls.__name__}.{f.name}: no flag for it; mark it NO_FLAG or give it one")
    names = [s.flag for s in out]
    if len(set(names)) != len(names):
        raise TypeError(f"two settings of {cls.__name__} would share a flag: {sorted(names)}")
    return out


class Options(BaseSettings):
    """The base of a command's options: its own fields (options of the command rather than settings) and, added
    by :func:`options_model`, one per setting."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        cli_hide_none_type=True,
        cli_exit_on_error=True,
        cli_show_env_vars=True,
    )


_O = TypeVar("_O", bound=Options)
_C = TypeVar("_C")


def options_model(base: type[_O], settings: Sequence[Setting]) -> type[_O]:
    """``base`` with an option for each of ``settings``; its docstring is the command's description."""
    fields = {s.path[-1]: (s.kind, Field(s.default, description=s.help)) for s in settings}
    model: type[_O] = create_model(  # type: ignore[call-overload]
        base.__name__, __base__=base, __doc__=base.__doc__, **fields
    )
    return model


def parse(model: type[_O], argv: list[str]) -> _O:
    """The options from ``argv`` and the environment; BadOption naming the flag or variable of a bad value
    (argparse itself exits, status 2, for an unknown flag or a missing value)."""
    try:
        return CliApp.run(model, cli_args=argv, cli_settings_source=_HelpSource(model))
    except ValidationError as err:
        e = err.errors()[0]
        name = str(e["loc"][0]) if e["loc"] else ""
        raise BadOption(f"{source(name, argv)}: {e['msg'].lower()}, got {e['input']!r}") from None


class _HelpSource(CliSettingsSource[BaseModel]):
    """pydantic-settings' command line whose help adds no "(default: ...)" where it says nothing: an empty default,
    or a help text that names its default itself."""

    def _help_format(
        self,
        field_name: str,
        field_info: FieldInfo,
        model_default: typing.Any,
        is_model_suppressed: bool,
        env_var_names: tuple[str, ...] = (),
    ) -> str:
        text = super()._help_format(field_name, field_info, model_default, is_model_suppressed, env_var_names)
        own = field_info.description or ""
        if text.startswith(own) and ("(default" in own or field_info.default == ""):
            tail = re.sub(r"^ ?\(default: [^)]*\)", "", text[len(own) :])
            text = own + tail
        return text


def source(name: str, argv: Sequence[str]) -> str:
    """Where the value of setting ``name`` came from: its flag when the command line gives it, else its
    variable when the environment does, else its flag."""
    flag = "--" + name.replace("_", "-")
    given = any(a == flag or a.startswith(flag + "=") or a == "--no-" + flag[2:] for a in argv)
    env = ENV_PREFIX + name.upper()
    return env if not given and env in {k.upper() for k in os.environ} else flag


def from_env(names: Iterable[str], argv: Sequence[str]) -> dict[str, str]:
    """Of the options ``names``, those whose values came from the environment, as their flags without the dashes
    (``keep-steps``, as errors name them) and the variables they came from."""
    came = {name: source(name, argv) for name in names}
    return {name.replace("_", "-"): where for name, where in came.items() if where.startswith(ENV_PREFIX)}


def build(cls: type[_C], options: BaseModel, settings: Sequence[Setting], /, **fixed: object) -> _C:
    """An instance of ``cls`` from parsed ``options``; ``fixed`` gives settings that have no flag."""
    values = {s.path: getattr(options, s.path[-1]) for s in settings}
    return cls(**_kwargs(cls, (), values), **fixed)


def _kwargs(cls: type, prefix: tuple[str, ...], values: dict[tuple[str, ...], object]) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        kind = hints[f.name]
        if path in values:
            kwargs[f.name] = values[path]
        elif dataclasses.is_dataclass(kind) and isinstance(kind, type) and NO_FLAG not in f.metadata:
            kwargs[f.name] = kind(**_kwargs(kind, path, values))
    return kwargs
