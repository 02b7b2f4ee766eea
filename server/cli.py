"""``rematd serve``: the service's command line, built from :class:`~rematd.server.config.ServeConfig`.

``python -m rematd.server.cli [serve] [options]`` runs it as well (without the client's dependencies).
"""

from __future__ import annotations

import logging
import sys
import typing
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rematd.server.config import ExposedWithoutToken, ServeConfig
from rematd.server.credentials import load_token
from rematd.server.flags import BadOption, Options, Setting, build, from_env, options_model, parse, settings_of
from rematd.server.run import bad_db, run_one
from rematd.server.runtime.log_limits import RepeatLimit
from rematd.server.store.database import StoreError

LogLevel = Literal["debug", "info", "warning", "error"]
PROG = "rematd serve"


class ServeOptions(Options):
    """Run the rematd service: gRPC, REST, /metrics."""

    model_config = SettingsConfigDict(cli_prog_name=PROG)
    # Not settings of the service: where the token comes from, how many processes, how much they log.
    token_file: str | None = Field(
        None,
        description="file whose first line is the bearer token writes need (else $REMATD_TOKEN); "
        "without a token, rematd listens on loopback only",
    )
    workers: int = Field(1, description="gRPC worker processes sharing the port (SO_REUSEPORT)")
    log_level: LogLevel = Field("info", description="how much the service logs")


def serve_options() -> tuple[type[ServeOptions], list[Setting]]:
    """The options model, and the settings of ServeConfig it has an option for."""
    settings = settings_of(ServeConfig)
    return options_model(ServeOptions, settings), settings


def _refuse(message: str) -> typing.NoReturn:
    print(f"usage: {PROG} [-h] [options]\n{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def serve(argv: list[str]) -> int:
    """``rematd serve`` with ``argv`` (its options, over ``REMATD_*`` variables); the exit status."""
    model, settings = serve_options()
    try:
        options = parse(model, argv)
    except BadOption as err:
        _refuse(str(err))
    # The service's own handler, its repeated lines limited (does nothing where logging is set up already).
    handler = logging.StreamHandler()
    handler.addFilter(RepeatLimit())
    logging.basicConfig(
        level=options.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[handler],
    )
    workers = options.workers
    try:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        config = build(ServeConfig, options, settings, token=load_token(options.token_file))
    except ExposedWithoutToken as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        _refuse(_with_variables(str(err), from_env(model.model_fields, argv)))
    if workers > 1:
        from rematd.server.workers import serve_workers

        try:
            return serve_workers(config, workers)
        except StoreError as err:
            return bad_db(config, err)
    return run_one(config)


def _with_variables(message: str, env: dict[str, str]) -> str:
    """``message`` naming the variable an option it names came from, where one did."""
    named = [variable for option, variable in env.items() if option in message]
    return f"{message} (set by {', '.join(named)})" if named else message


def main(argv: list[str] | None = None) -> int:
    """``rematd serve``'s options, after an optional ``serve``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        args = args[1:]
    elif args[:1] == ["demo"]:
        # The service does not import the client: the demo is the rematd command's.
        print("rematd.server.cli runs the service only: the demo is `rematd demo`", file=sys.stderr)
        return 2
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
