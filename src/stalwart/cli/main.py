"""Entry point of the ``stalwart`` command.

User errors (:class:`stalwart.errors.StalwartError`, bad files, bad flags) print one
line and exit 2; anything else is a bug and keeps its traceback. Diagnostics of the parts
(a crash detected, a peer refused) go through :mod:`logging` in one format, installed here
when the command starts (:mod:`stalwart.logs`), not at import.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from stalwart import __version__
from stalwart.errors import StalwartError
from stalwart.logs import install as install_logging

__all__ = ["build_parser", "main"]

# Subcommand modules, imported lazily so that `stalwart --help` stays fast.
_COMMAND_MODULES: tuple[str, ...] = (
    "stalwart.cli.ckpt",
    "stalwart.cli.sim",
    "stalwart.cli.run",
    "stalwart.cli.chaos",
    "stalwart.cli.report",
    "stalwart.cli.check",
    "stalwart.cli.compare",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stalwart",
        description="Fault-tolerance runtime for PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"stalwart {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    install_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except StalwartError as err:
        print(f"stalwart: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stalwart: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `stalwart ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
