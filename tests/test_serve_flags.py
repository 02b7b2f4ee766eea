"""``rematd serve``'s flags come from ServeConfig: each setting has one, with the field's default and help."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from typing import Any

import pytest

from rematd.server.cli import main, serve_parser
from rematd.server.config import NO_FLAG, CoreConfig, GrpcOptions, ServeConfig, StoreConfig
from rematd.server.flags import attribute_docs, build, flags_of


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
    parser, flags = serve_parser()
    by_path = {flag.path: flag for flag in flags}
    options = {opt: action for action in parser._actions for opt in action.option_strings}
    for path, f in settings(ServeConfig).items():
        if NO_FLAG in f.metadata:
            assert path not in by_path and f.metadata[NO_FLAG], path
            continue
        flag = by_path[path]
        assert flag.name == "--" + path[-1].replace("_", "-")
        assert flag.name in options, f"{path} has no flag"
        assert parser.get_default(flag.dest) == field_default(f), path
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
    parser, flags = serve_parser()
    assert build(ServeConfig, parser.parse_args([]), flags) == ServeConfig()


def test_the_flags_that_existed_keep_their_names_and_defaults() -> None:
    parser, _ = serve_parser()
    before = {
        "--grpc-host": "127.0.0.1", "--grpc-port": 50051, "--http-host": "127.0.0.1", "--http-port": 8080,
        "--retention-days": 30.0, "--keep-steps": 2000, "--bucket-seconds": 300.0, "--max-message-bytes": 1 << 20,
        "--grace-seconds": 5.0, "--drain-seconds": 0.0, "--session-expiry-seconds": 900.0,
        "--max-report-interval-seconds": 10.0, "--workers": 1, "--log-level": "info", "--tls-cert": "",
        "--tls-key": "", "--public-reads": False, "--per-rank-metrics": False, "--token-file": None,
    }  # fmt: skip
    options = {opt: action for action in parser._actions for opt in action.option_strings}
    for name, default in before.items():
        assert name in options, name
        assert options[name].default == default, name
    assert "--db" in options


def test_flags_reach_the_parts_settings() -> None:
    parser, flags = serve_parser()
    args = parser.parse_args(
        [
            *("--keep-steps", "7", "--session-expiry-seconds", "3", "--max-message-bytes", "4096", "--no-warm-start"),
            *("--public-reads", "--quiet-steps", "5", "--grpc-port", "0", "--compact-seconds", "60"),
        ]
    )
    config = build(ServeConfig, args, flags, token="a-token-of-sixteen-chars")
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
    _, flags = serve_parser()
    for flag in flags:
        assert flag.name in text, flag.name
        assert flag.help, f"{flag.dest} has no attribute docstring"
        assert " ".join(flag.help.split()[:6]) in text, flag.name
    for name in ("--token-file", "--workers", "--log-level", "--no-public-reads"):
        assert name in text


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
        flags_of(Odd)
    assert attribute_docs(Odd) == {"ratio": "A ratio."}

    @dataclasses.dataclass
    class Twice:
        a: CoreConfig = dataclasses.field(default_factory=CoreConfig)
        b: CoreConfig = dataclasses.field(default_factory=CoreConfig)

    with pytest.raises(TypeError, match="share a flag"):
        flags_of(Twice)
