"""``stalwart run``'s flags for the detectors (hang, hang at exit, straggler, degraded
link) and the LaunchConfig fields they make, one group with one reader: the detectors'
flags change with the detectors (agent/detection/_detectors.py runs them; docs/detection.md),
not with the launcher's."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["detection", "detection_flags"]


def detection_flags(p: argparse.ArgumentParser) -> None:
    """The detectors' flags (docs/detection.md)."""
    p.add_argument(
        "--hang-floor",
        type=float,
        default=1.0,
        help="seconds a stopped worker (SIGSTOP, state T) may stay stopped before it is "
        "killed as hung, whatever its step time (default 1); also the least bound of the "
        "step-time rules, max(floor, k x p99 step)",
    )
    p.add_argument("--hang-k", type=float, default=3.0, help="x p99 step time (default 3)")
    p.add_argument(
        "--hang-idle",
        type=float,
        default=300.0,
        help="seconds without CPU progress on any worker (none computing, none in "
        "sess.pause) before an idle worker is killed as stuck (default 300). A busy "
        "worker, and a worker waiting for it, is never killed",
    )
    p.add_argument(
        "--exit-grace",
        type=float,
        default=60.0,
        help="once a rank finished the job (exited 0), seconds another may make no "
        "progress (no CPU, no step) before it is ended as hung at exit (default 60); the "
        "job ends with its result (rc 0), never restarted",
    )
    p.add_argument(
        "--on-straggler",
        choices=("report", "evict"),
        default="report",
        help="a rank computing persistently slower than the others (stalwart.init() "
        "scripts): report it (default: an event, the report's section, a metric) or "
        "evict it (replaced by the strategy's means: spare, flash, restart, elastic)",
    )
    p.add_argument(
        "--on-degraded",
        choices=("report", "evict"),
        default="report",
        help="a degraded link between nodes (the step rate collapses while every rank "
        "computes as before: loss or delay): report it (default: a link_degraded event "
        "and a line, then link_recovered) or evict the node behind it (fenced and "
        "recovered as a lost node)",
    )


def detection(args: argparse.Namespace) -> dict[str, Any]:
    """The detectors' settings (hang, straggler, degraded link), as LaunchConfig fields."""
    from stalwart.agent import HangConfig
    from stalwart.agent.detection.degraded import DegradedAction, DegradedConfig
    from stalwart.agent.detection.stragglers import StragglerAction, StragglerConfig

    return {
        "hang": HangConfig(
            floor_s=args.hang_floor,
            k=args.hang_k,
            idle_s=args.hang_idle,
            exit_grace_s=args.exit_grace,
        ),
        "straggler": StragglerConfig(action=StragglerAction.parse(args.on_straggler)),
        "degraded": DegradedConfig(action=DegradedAction.parse(args.on_degraded)),
    }
