"""``stalwart run``'s flags for the node itself: its health probes and preflight check
(docs/detection.md), its health endpoint and the job's metrics endpoint and progress line
(docs/launch.md). One group with its own readers (agent/health/), as the detectors'
flags are (cli/_detect_flags.py)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["node_flags", "node_options"]


def node_flags(p: argparse.ArgumentParser) -> None:
    """Register the node's flags on ``stalwart run``'s parser."""
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port of --metrics-host (node 0; 0 picks one)",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="0.0.0.0 in a pod")
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve this node's /healthz and /readyz here (every node; 0 picks one)",
    )
    p.add_argument("--health-host", default="127.0.0.1", help="0.0.0.0 in a pod (kubelet)")
    p.add_argument("--progress", action="store_true", help="a live progress line on stderr")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="before the first generation, every node runs a small matmul and an allreduce "
        "with a partner; a node far slower than the others is paired again with a fast "
        "one (slow node or slow link?) and a slow or failing node leaves the job, its "
        "ranks moved to a healthy node (see also `stalwart check`)",
    )
    p.add_argument(
        "--probes",
        default="all",
        help="node health probes: all (default), none, or some of host,shm,disk,nvml "
        "(nvml needs pynvml and a GPU, else it is skipped with a note)",
    )
    p.add_argument(
        "--probe-interval",
        type=float,
        default=10.0,
        help="seconds between probe rounds (default 10)",
    )
    p.add_argument(
        "--probe-limits",
        default=None,
        help="bounds, K=V comma-separated: host_min_available (fraction, 0.05), "
        "shm_reserve_mb (64), disk_min_free_mb (1024), disk_min_mb_s (2), "
        "write_every_s (300), gpu_max_temp_c (90)",
    )
    p.add_argument(
        "--on-probe",
        default="isolate",
        help="a failing probe: isolate (default: blocklist the node, its ranks move to a "
        "healthy node) or report (events only)",
    )


def node_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~stalwart.agent.LaunchConfig` fields these flags set."""
    from stalwart.agent.health.endpoint import HealthEndpointConfig
    from stalwart.agent.health.probes import parse_probe_limits, parse_probe_names

    names = parse_probe_names(args.probes)
    probes = parse_probe_limits(
        args.probe_limits, names=names, interval_s=args.probe_interval, on_failure=args.on_probe
    )
    return {
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "health": HealthEndpointConfig(port=args.health_port, host=args.health_host),
        "progress": args.progress,
        "probes": probes,
        "preflight": args.preflight,
    }
