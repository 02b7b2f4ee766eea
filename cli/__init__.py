"""The ``rematd`` command: ``rematd serve`` runs the service, ``rematd demo`` trains a small model against it."""

from __future__ import annotations

import sys

from rematd import __version__

COMMANDS = {"serve": "run the service", "demo": "train a small model against the service, on the CPU"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: rematd {{{','.join(COMMANDS)}}} [options]\n")
        for name, text in COMMANDS.items():
            print(f"  {name:7s} {text}")
        print("\n'rematd COMMAND --help' for a command's options")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        try:
            from rematd.server.cli import serve
        except ImportError as err:
            print(f"rematd serve needs the server extra: {err}", file=sys.stderr)
            return 1
        return serve(rest)
    if command == "demo":
        try:
            from rematd.cli.demo import main as demo_main
        except ImportError as err:
            print(f"rematd demo needs the client extra (torch): {err}", file=sys.stderr)
            return 1
        return demo_main(rest)
    print(f"rematd: unknown command {command!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
    return 2
