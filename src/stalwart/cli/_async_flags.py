"""`stalwart run`'s flags of ``--strategy async`` (docs/async.md)."""

from __future__ import annotations

import argparse

from stalwart.errors import ConfigError

__all__ = ["async_flags", "outer_settings"]


def async_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--strategy async (replica groups: LocalSGD / DiLoCo)")
    g.add_argument(
        "--replica-groups",
        type=int,
        default=0,
        help="replica groups of consecutive ranks, each training apart (default: one per worker)",
    )
    g.add_argument(
        "--sync-every", type=int, default=50, help="steps between synchronisations (default 50)"
    )
    g.add_argument(
        "--outer",
        choices=("diloco", "localsgd"),
        default="diloco",
        help="diloco: Nesterov outer step on the pseudo-gradient (default); localsgd: the "
        "groups' parameters averaged",
    )
    g.add_argument("--outer-lr", type=float, default=None, help="diloco's outer rate (0.7)")
    g.add_argument(
        "--outer-momentum", type=float, default=None, help="diloco's Nesterov momentum (0.9)"
    )


def outer_settings(args: argparse.Namespace) -> tuple[float, float]:
    """(outer lr, momentum) of --outer: localsgd is lr 1, momentum 0, the plain mean."""
    if args.outer == "localsgd":
        if args.outer_lr is not None or args.outer_momentum is not None:
            raise ConfigError(
                "--outer localsgd averages the parameters: drop --outer-lr/--outer-momentum "
                "(or use --outer diloco)"
            )
        return 1.0, 0.0
    lr = 0.7 if args.outer_lr is None else args.outer_lr
    return lr, 0.9 if args.outer_momentum is None else args.outer_momentum
