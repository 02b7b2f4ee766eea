"""The ``rematd`` command: ``rematd serve`` and ``rematd demo``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from typing import TYPE_CHECKING

from rematd import __version__

if TYPE_CHECKING:
    from rematd.server.app import ServeConfig


def _serve_parser() -> argparse.ArgumentParser:
    from rematd.server.app import default_db_path

    p = argparse.ArgumentParser(prog="rematd serve", description="Run the rematd service: gRPC, REST, /metrics.")
    p.add_argument("--grpc-host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port (default 50051)")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8080, help="0 picks a free port (default 8080)")
    p.add_argument(
        "--db",
        default=str(default_db_path()),
        help="SQLite file, or a database URL such as postgresql://user@host/rematd (default %(default)s)",
    )
    p.add_argument(
        "--token-file",
        help="file whose first line is the bearer token writes need (else $REMATD_TOKEN); "
        "without a token, rematd listens on loopback only",
    )
    p.add_argument("--public-reads", action="store_true", help="serve reads without a token on a non-loopback address")
    p.add_argument("--tls-cert", default="", help="PEM certificate chain: TLS for gRPC and HTTP")
    p.add_argument("--tls-key", default="", help="PEM private key for --tls-cert")
    p.add_argument("--retention-days", type=float, default=30.0, help="keep stats and OOM events this long (30)")
    p.add_argument("--keep-steps", type=int, default=2000, help="latest steps per rank kept at full resolution")
    p.add_argument("--bucket-seconds", type=float, default=300.0, help="older steps: one row per rank per bucket")
    p.add_argument("--per-rank-metrics", action="store_true", help="export per-rank series besides per-job ones")
    p.add_argument("--max-message-bytes", type=int, default=1 << 20, help="largest gRPC message a rank may send")
    p.add_argument(
        "--grace-seconds", type=float, default=5.0, help="at shutdown, time the last messages get to finish (5)"
    )
    p.add_argument("--drain-seconds", type=float, default=0.0, help="NOT_SERVING this long before stopping")
    p.add_argument(
        "--session-expiry-seconds",
        type=float,
        default=900.0,
        help="forget a rank whose stream has been gone this long; its job's series go with its last rank (900)",
    )
    p.add_argument(
        "--max-report-interval-seconds",
        type=float,
        default=10.0,
        help="how long a steady rank may fold its steps into one report; 0 asks for every step (10)",
    )
    p.add_argument("--workers", type=int, default=1, help="gRPC worker processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _serve(argv: list[str]) -> int:
    from rematd.server.app import ExposedWithoutToken, ServeConfig
    from rematd.server.auth import load_token
    from rematd.server.store import StoreError

    parser = _serve_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.workers < 1:
            raise ValueError(f"workers must be >= 1, got {args.workers}")
        token = load_token(args.token_file)
        config = ServeConfig(
            grpc_host=args.grpc_host,
            grpc_port=args.grpc_port,
            http_host=args.http_host,
            http_port=args.http_port,
            db=args.db,
            token=token,
            public_reads=args.public_reads,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            retention_days=args.retention_days,
            keep_steps=args.keep_steps,
            bucket_seconds=args.bucket_seconds,
            per_rank_metrics=args.per_rank_metrics,
            max_message_bytes=args.max_message_bytes,
            grace_seconds=args.grace_seconds,
            drain_seconds=args.drain_seconds,
            session_expiry_seconds=args.session_expiry_seconds,
            max_report_interval_seconds=args.max_report_interval_seconds,
            reuse_port=args.workers > 1,
        )
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
            return _bad_db(config, err)
    return _run_one(config)


def _bad_db(config: ServeConfig, err: Exception) -> int:
    from rematd.server.app import default_db_path
    from rematd.server.store import redact_url

    print(f"rematd serve: --db {redact_url(config.db or str(default_db_path()))}: {err}", file=sys.stderr)
    return 2


def _run_one(config: ServeConfig, *, announce: bool = True) -> int:
    from rematd.server.app import Service
    from rematd.server.store import StoreError

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        service = Service(config)
        task = asyncio.create_task(service.run(stop))
        while service.bound is None and not task.done():
            await asyncio.sleep(0.01)
        if service.bound is not None:
            # Start-up objects live as long as the process: keep the collector's full passes off them.
            gc.collect()
            gc.freeze()
            if announce:
                b = service.bound
                print(f"rematd {__version__} serving gRPC on {b.grpc}{' (TLS)' if b.tls else ''}", flush=True)
                if config.http:
                    scheme = "https" if b.tls else "http"
                    print(f"dashboard and REST on {scheme}://{b.http}/ (metrics at /metrics)", flush=True)
                print(f"record: {b.db}", flush=True)
        await task

    # Fewer, larger young-generation collections: a busy service allocates many short-lived messages.
    # Memory that ended streams held does not wait for these thresholds: the gRPC servicer asks for a
    # collection soon after streams end (rematd.server.grpc_service).
    gc.set_threshold(50_000, 20, 100)
    try:
        asyncio.run(main())
    except StoreError as err:
        return _bad_db(config, err)
    except (OSError, RuntimeError) as err:
        print(f"rematd serve: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"serve": "run the service", "demo": "train a small model against the service, on the CPU"}
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: rematd {{{','.join(commands)}}} [options]\n")
        for name, text in commands.items():
            print(f"  {name:7s} {text}")
        print("\n'rematd COMMAND --help' for a command's options")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return _serve(rest)
    if command == "demo":
        try:
            from rematd.client.demo import main as demo_main
        except ImportError as err:
            print(f"rematd demo needs the client extra (torch): {err}", file=sys.stderr)
            return 1
        return demo_main(rest)
    print(f"rematd: unknown command {command!r}; choose from {', '.join(commands)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
