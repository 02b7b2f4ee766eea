"""``rematd serve``: the service's command line, built from :class:`~rematd.server.config.ServeConfig`.

``python -m rematd.server.cli [serve] [options]`` runs it as well (without the client's dependencies).
"""

from __future__ import annotations

import argparse
import logging
import sys

from rematd.server.config import ExposedWithoutToken, ServeConfig
from rematd.server.flags import Flag, add_flags, build
from rematd.server.run import bad_db, run_one
from rematd.server.runtime.log_limits import RepeatLimit
from rematd.server.store.database import StoreError
from rematd.server.transport.auth import load_token

LOG_LEVELS = ("debug", "info", "warning", "error")


def serve_parser() -> tuple[argparse.ArgumentParser, list[Flag]]:
    """The parser, and the flags it has for ServeConfig's settings."""
    p = argparse.ArgumentParser(prog="rematd serve", description="Run the rematd service: gRPC, REST, /metrics.")
    flags = add_flags(p, ServeConfig)
    # Not settings of the service: where the token comes from, how many processes, how much they log.
    p.add_argument(
        "--token-file",
        help="file whose first line is the bearer token writes need (else $REMATD_TOKEN); "
        "without a token, rematd listens on loopback only",
    )
    p.add_argument("--workers", type=int, default=1, help="gRPC worker processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    return p, flags


def serve(argv: list[str]) -> int:
    """``rematd serve`` with ``argv`` (its options); the exit status."""
    parser, flags = serve_parser()
    args = parser.parse_args(argv)
    # The service's own handler, its repeated lines limited (does nothing where logging is set up already).
    handler = logging.StreamHandler()
    handler.addFilter(RepeatLimit())
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=[handler]
    )
    try:
        if args.workers < 1:
            raise ValueError(f"workers must be >= 1, got {args.workers}")
        config: ServeConfig = build(ServeConfig, args, flags, token=load_token(args.token_file))
    except ExposedWithoutToken as err:
        print(f"rematd serve: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        parser.error(str(err))
    if args.workers > 1:
        from rematd.server.workers import serve_workers

        try:
            return serve_workers(config, args.workers)
        except StoreError as err:
            return bad_db(config, err)
    return run_one(config)


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
