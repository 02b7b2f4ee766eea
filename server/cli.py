"""The ``rematd`` command: ``rematd serve`` and ``rematd demo``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from rematd import __version__


def _serve(argv: list[str]) -> int:
    from rematd.server.app import ServeConfig, Service, default_db_path

    parser = argparse.ArgumentParser(prog="rematd serve", description="Run the rematd service: gRPC, REST, /metrics.")
    parser.add_argument("--grpc-host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port (default 50051)")
    parser.add_argument("--http-host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8080, help="0 picks a free port (default 8080)")
    parser.add_argument("--db", default=str(default_db_path()), help="SQLite file (default %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ServeConfig(
            grpc_host=args.grpc_host,
            grpc_port=args.grpc_port,
            http_host=args.http_host,
            http_port=args.http_port,
            db=args.db,
        )
    except ValueError as err:
        parser.error(str(err))

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
            b = service.bound
            print(f"rematd {__version__} serving gRPC on {b.grpc}", flush=True)
            print(f"dashboard and REST on http://{b.http}/ (metrics at /metrics)", flush=True)
            print(f"record: {b.db}", flush=True)
        await task

    try:
        asyncio.run(main())
    except OSError as err:
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
