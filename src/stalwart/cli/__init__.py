"""The ``stalwart`` command line. Each subcommand lives in its own module with a
``register(subparsers)`` function; :mod:`stalwart.cli.main` wires them together."""

from __future__ import annotations

__all__: list[str] = []
