"""``stalwart run``'s flags for silent data corruption and numerical faults: their own
module so that cli/run.py stays under 400 lines (runtime/_integrity.py reads them from
the worker contract; docs/detection.md)."""

from __future__ import annotations

import argparse

__all__ = ["integrity_flags"]


def integrity_flags(p: argparse.ArgumentParser) -> None:
    """Silent data corruption and numerical faults (docs/detection.md)."""
    from stalwart.contract.env import DEFAULTS, NAN_POLICIES, SDC_POLICIES

    p.add_argument(
        "--sdc-every",
        type=int,
        default=DEFAULTS.sdc_every,
        help="compare the DDP replicas' state digests every this many steps (default "
        f"{DEFAULTS.sdc_every}; 0: off)",
    )
    p.add_argument(
        "--on-sdc",
        choices=SDC_POLICIES,
        default=DEFAULTS.on_sdc,
        help="a replica mismatch: roll back to the newest snapshot all replicas agreed on, "
        f"also evict the minority rank, or only report (default {DEFAULTS.on_sdc})",
    )
    p.add_argument(
        "--on-nan",
        choices=NAN_POLICIES,
        default=DEFAULTS.on_nan,
        help="a NaN/inf or spiking sess.log(loss=...): report, or roll back before it and "
        f"skip that step's batch (default {DEFAULTS.on_nan})",
    )
    p.add_argument(
        "--spike-z",
        type=float,
        default=DEFAULTS.spike_z,
        help=f"z-score that makes a loss a spike (default {DEFAULTS.spike_z:g}; 0: NaN/inf only)",
    )
    p.add_argument(
        "--spike-window",
        type=int,
        default=DEFAULTS.spike_window,
        help=f"losses per rank the spike's mean/std are over (default {DEFAULTS.spike_window})",
    )
