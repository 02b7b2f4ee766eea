"""``rematd serve``'s flags come from ServeConfig: each setting has one, with the field's default and help, and a
``REMATD_*`` variable the command line overrides."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from rematd.server.cli import main, serve_options
from rematd.server.config import NO_FLAG, CoreConfig, GrpcOptions, ServeConfig, StoreConfig
from rematd.server.flags import ENV_PREFIX, attribute_docs, build, parse, settings_of


@pytest.fixture(autouse=True)
def _no_rematd_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Options come from the command line and the variables each test sets, not from the shell running it."""
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def config_of(argv: list[str], **fixed: object) -> ServeConfig:
    model, settings = serve_options()
    return build(ServeConfig, parse(model, argv), settings, **fixed)


def settings(cls: type, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], dataclasses.Field[Any]]:
    """Every leaf setting of a settings dataclass, by its path from the top."""
    hints = typing.get_type_hints(cls)
    out: dict[tuple[str, ...], dataclasses.Field[Any]] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            out |= settings(kind, (*prefix, f.name))
        else:
            out[(*prefix, f.name)] = f
    return out


def field_default(f: dataclasses.Field[Any]) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def test_every_setting_has_a_flag_with_the_fields_default_unless_it_says_why_not() -> None:
    model, options = serve_options()
    by_path = {s.path: s for s in options}
    for path, f in settings(ServeConfig).items():
        if NO_FLAG in f.metadata:
            assert path not in by_path and f.metadata[NO_FLAG], path
            continue
        option = by_path[path]
        assert option.flag == "--" + path[-1].replace("_", "-")
        assert option.env == "REMATD_" + path[-1].upper()
        assert model.model_fields[path[-1]].default == field_default(f), path
    without = {path for path, f in settings(ServeConfig).items() if NO_FLAG in f.metadata}
    assert without == {
        ("token",),
        ("http",),
        ("worker_index",),
        ("shared_dir",),
        ("store", "url"),
        ("grpc", "reuse_port"),
    }


def test_no_flags_give_the_default_config() -> None:
    assert config_of([]) == ServeConfig()


def test_the_flags_that_existed_keep_their_names_and_defaults() -> None:
    model, _ = serve_options()
    before = {
        "--grpc-host": "127.0.0.1", "--grpc-port": 50051, "--http-host": "127.0.0.1", "--http-port": 8080,
        "--retention-days": 30.0, "--keep-steps": 2000, "--bucket-seconds": 300.0, "--max-message-bytes": 1 << 20,
        "--grace-seconds": 5.0, "--drain-seconds": 0.0, "--session-expiry-seconds": 900.0,
        "--max-report-interval-seconds": 10.0, "--workers": 1, "--log-level": "info", "--tls-cert": "",
        "--tls-key": "", "--public-reads": False, "--per-rank-metrics": False, "--token-file": None,
    }  # fmt: skip
    for name, default in before.items():
        field = name[2:].replace("-", "_")
        assert field in model.model_fields, name
        assert model.model_fields[field].default == default, name
    assert "db" in model.model_fields


def test_flags_reach_the_parts_settings() -> None:
    config = config_of(
        [
            *("--keep-steps", "7", "--session-expiry-seconds", "3", "--max-message-bytes", "4096", "--no-warm-start"),
            *("--public-reads", "--quiet-steps", "5", "--grpc-port", "0", "--compact-seconds", "60"),
        ],
        token="a-token-of-sixteen-chars",
    )
    assert config.store == StoreConfig(keep_steps=7)
    assert config.core == CoreConfig(session_expiry_seconds=3, warm_start=False, quiet_steps=5)
    assert config.grpc == GrpcOptions(max_message_bytes=4096)
    assert config.public_reads and config.grpc_port == 0 and config.compact_seconds == 60
    assert config.token == "a-token-of-sixteen-chars"


def test_help_documents_every_flag_with_its_settings_text() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rematd.server.cli", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    _, options = serve_options()
    for option in options:
        assert option.flag in text, option.flag
        assert option.help, f"{option.path} has no attribute docstring"
        assert " ".join(option.help.split()[:6]) in text, option.flag
        assert f"[env: {option.env}]" in text, option.env
    for name in ("--token-file", "--workers", "--log-level", "--no-public-reads", "REMATD_LOG_LEVEL"):
        assert name in text
    # Each option's help names its default once, and never an empty one.
    assert "(default: )" not in text
    for chunk in re.split(r" --(?=[a-z])", text):
        assert chunk.count("(default") <= 1, chunk


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--keep-steps", "0"], "keep-steps"),
        (["--session-expiry-seconds", "0"], "session-expiry-seconds"),
        (["--max-message-bytes", "10"], "max-message-bytes"),
        (["--keepalive-seconds", "-1"], "keepalive-seconds"),
        (["--http-port", "70000"], "http-port"),
        (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "tls-cert"),
        (["--workers", "0"], "workers"),
    ],
)
def test_a_bad_value_is_refused_naming_its_flag(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["serve", *args])
    assert exit.value.code == 2
    assert named in capsys.readouterr().err


def test_a_setting_the_flags_cannot_carry_is_refused_when_the_parser_is_built() -> None:
    @dataclasses.dataclass
    class Odd:
        ratio: float = 0.5
        """A ratio."""
        pairs: list[int] = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match=r"Odd\.pairs"):
        settings_of(Odd)
    assert attribute_docs(Odd) == {"ratio": "A ratio."}

    @dataclasses.dataclass
    class Twice:
        a: CoreConfig = dataclasses.field(default_factory=CoreConfig)
        b: CoreConfig = dataclasses.field(default_factory=CoreConfig)

    with pytest.raises(TypeError, match="share a flag"):
        settings_of(Twice)


def test_a_setting_comes_from_its_variable_and_the_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMATD_KEEP_STEPS", "7")
    monkeypatch.setenv("REMATD_WARM_START", "false")
    monkeypatch.setenv("REMATD_GRPC_HOST", "127.0.0.2")
    config = config_of([])
    assert config.store.keep_steps == 7 and not config.core.warm_start and config.grpc_host == "127.0.0.2"
    config = config_of(["--keep-steps", "9", "--warm-start", "--grpc-host=127.0.0.3"])
    assert config.store.keep_steps == 9 and config.core.warm_start and config.grpc_host == "127.0.0.3"
    model, _ = serve_options()
    monkeypatch.setenv("REMATD_LOG_LEVEL", "debug")
    assert parse(model, []).log_level == "debug" and parse(model, ["--log-level", "error"]).log_level == "error"


@pytest.mark.parametrize(
    ("variable", "value", "argv", "named"),
    [
        ("REMATD_KEEP_STEPS", "many", [], "REMATD_KEEP_STEPS"),
        ("REMATD_KEEP_STEPS", "0", [], "REMATD_KEEP_STEPS"),
        ("REMATD_PUBLIC_READS", "maybe", [], "REMATD_PUBLIC_READS"),
        ("REMATD_LOG_LEVEL", "loud", [], "REMATD_LOG_LEVEL"),
        ("REMATD_WORKERS", "0", [], "REMATD_WORKERS"),
        # A bad value on the command line is the flag's, whatever the variable holds.
        ("REMATD_KEEP_STEPS", "7", ["--keep-steps", "many"], "--keep-steps"),
    ],
)
def test_a_bad_value_from_the_environment_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    argv: list[str],
    named: str,
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit:
        main(["serve", *argv])
    assert exit.value.code == 2
    assert named in capsys.readouterr().err


def test_the_service_docs_list_every_flag_with_its_variable() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "service.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(): line for line in docs.splitlines() if line.startswith("| `--")}
    model, _ = serve_options()
    for name in model.model_fields:
        flag, env = "--" + name.replace("_", "-"), "REMATD_" + name.upper()
        row = next((line for first, line in rows.items() if first.strip("`").split(",")[0] == flag), None)
        assert row is not None, f"{flag} is not in docs/service.md"
        assert f"`{env}`" in row, flag
