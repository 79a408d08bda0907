"""`stalwart run`'s flags of ``--strategy async`` (docs/async.md)."""

from __future__ import annotations

import argparse

from stalwart.cli._knob_flags import knob_flag
from stalwart.contract.env import DEFAULTS
from stalwart.errors import ConfigError

__all__ = ["async_flags", "outer_settings"]


def async_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--strategy async (replica groups: LocalSGD / DiLoCo)")
    knob_flag(g, "replica_groups")
    knob_flag(g, "sync_every")
    g.add_argument(
        "--outer",
        choices=("diloco", "localsgd"),
        default="diloco",
        help="diloco: Nesterov outer step on the pseudo-gradient (default); localsgd: the "
        "groups' parameters averaged",
    )
    knob_flag(g, "outer_lr")
    knob_flag(g, "outer_momentum")


def outer_settings(args: argparse.Namespace) -> tuple[float, float]:
    """(outer lr, momentum) of --outer: localsgd is lr 1, momentum 0, the plain mean."""
    if args.outer == "localsgd":
        if args.outer_lr is not None or args.outer_momentum is not None:
            raise ConfigError(
                "--outer localsgd averages the parameters: drop --outer-lr/--outer-momentum "
                "(or use --outer diloco)"
            )
        return 1.0, 0.0
    lr = DEFAULTS.outer_lr if args.outer_lr is None else args.outer_lr
    return lr, DEFAULTS.outer_momentum if args.outer_momentum is None else args.outer_momentum
