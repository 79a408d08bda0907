"""The scenario flags of ``stalwart plan`` and ``stalwart simulate``, and the scenario
they describe: a preset, then a calibration file if given, then the flags (flags always
win; no environment variable changes anything)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any

from stalwart.errors import ConfigError

if TYPE_CHECKING:
    from stalwart.sim import ClusterConfig, FailureModel, Scenario

__all__ = ["add_scenario_flags", "build_scenario", "parse_bytes", "replica_count"]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "PIB": 2**50,
}


def parse_bytes(text: str) -> float:
    """``"2TB"`` -> 2e12, ``"1.5GiB"`` -> 1.5 * 2**30; ConfigError on anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot read size {text!r}; write a number with a unit, e.g. 2TB or 500GiB"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ConfigError(f"size must be > 0, got {text!r}")
    return value


def add_scenario_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scenario")
    g.add_argument("--preset", default="llama3-54d", help="llama3-54d, meta-rsc1 or meta-rsc2")
    g.add_argument("--calibration", metavar="FILE", help="costs measured on a real run (JSON)")
    g.add_argument("--gpus", type=int, help="GPUs in the job (a multiple of --gpus-per-node)")
    g.add_argument("--gpus-per-node", type=int)
    g.add_argument("--days", type=float, help="length of the run")
    g.add_argument("--spares", type=int, help="hot spare nodes outside the job")
    g.add_argument("--repair-hours", type=float, help="mean time to repair a replaced node")
    f = p.add_argument_group("failures (replace the preset's causes)")
    f.add_argument("--mtbf-hours", type=float, help="job-level mean time between failures")
    f.add_argument("--failures-per-1000-node-days", type=float, dest="node_rate")
    f.add_argument("--distribution", choices=("exponential", "weibull"))
    f.add_argument("--weibull-shape", type=float)
    c = p.add_argument_group("costs (seconds unless stated)")
    c.add_argument(
        "--ckpt-bytes", help="checkpoint size, e.g. 2TB; with --write-gbps sets the save"
    )
    c.add_argument("--write-gbps", type=float, help="aggregate storage write bandwidth, GB/s")
    c.add_argument("--sync-save-s", type=float, help="stall of a synchronous save (restart)")
    c.add_argument("--snapshot-stall-s", type=float, help="stall of an in-memory snapshot")
    c.add_argument("--persist-s", type=float, help="background persist time of a snapshot")
    c.add_argument("--restart-s", type=float, help="relaunch of every worker (restart)")
    c.add_argument("--node-replace-s", type=float, help="swapping a spare node into the job")
    c.add_argument("--interval-min", type=float, help="checkpoint interval (default: Daly's)")
    c.add_argument("--async-penalty", type=float, help="share of async time lost to convergence")
    c.add_argument("--async-group-nodes", type=int, help="nodes per async replica group")
    r = p.add_argument_group("run")
    r.add_argument("--strategy", default="all", help="comma-separated strategies, or all")
    r.add_argument("--replicas", type=int, help="Monte Carlo replicas")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    r.add_argument(
        "--out",
        metavar="DIR",
        help="write PNG plots into DIR (their sweeps use at most 64 and 32 replicas)",
    )


def build_scenario(args: argparse.Namespace) -> Any:
    from stalwart.sim import preset
    from stalwart.sim.calibration import apply_calibration, load_calibration

    sc = preset(args.preset)
    if args.calibration:
        sc = apply_calibration(sc, load_calibration(args.calibration))
    cluster = _cluster(args, sc.cluster)
    failures, source = _failures(args, sc, cluster)
    fchanges: dict[str, Any] = {}
    if args.distribution is not None:
        fchanges["distribution"] = args.distribution
    if args.weibull_shape is not None:
        fchanges["weibull_shape"] = args.weibull_shape
    failures = dataclasses.replace(failures, **fchanges)
    costs: dict[str, Any] = {}
    if args.restart_s is not None:
        costs["restart_s"] = args.restart_s
    if args.node_replace_s is not None:
        costs["node_replace_s"] = args.node_replace_s
    horizon = sc.horizon_s if args.days is None else args.days * 86400.0
    return dataclasses.replace(
        sc,
        cluster=cluster,
        failures=failures,
        job=dataclasses.replace(sc.job, **_job_changes(args)),
        costs=dataclasses.replace(sc.costs, **costs),
        horizon_s=horizon,
        source=source,
    )


def _cluster(args: argparse.Namespace, cluster: ClusterConfig) -> ClusterConfig:
    """The preset's cluster with --gpus, --gpus-per-node, --spares, --repair-hours."""
    from stalwart.sim import ClusterConfig

    per_node = args.gpus_per_node if args.gpus_per_node is not None else cluster.gpus_per_node
    if per_node < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1, got {per_node}")
    gpus = args.gpus if args.gpus is not None else cluster.gpus
    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {gpus}; a job needs at least one GPU")
    if gpus % per_node:
        raise ConfigError(
            f"--gpus {gpus} is not a whole number of {per_node}-GPU nodes; "
            f"pass a multiple of {per_node} or set --gpus-per-node"
        )
    changes: dict[str, Any] = {"nodes": gpus // per_node, "gpus_per_node": per_node}
    if args.spares is not None:
        changes["spare_nodes"] = args.spares
    if args.repair_hours is not None:
        changes["repair_s"] = args.repair_hours * 3600.0
    return ClusterConfig(**{**dataclasses.asdict(cluster), **changes})


def _failures(
    args: argparse.Namespace, sc: Scenario, cluster: ClusterConfig
) -> tuple[FailureModel, str]:
    """The failure model (the preset's, or one of --mtbf-hours /
    --failures-per-1000-node-days) and the scenario's source line saying which."""
    from stalwart.sim import FailureCause, FailureModel

    failures = sc.failures
    source = sc.source
    if args.mtbf_hours is not None and args.node_rate is not None:
        raise ConfigError("give --mtbf-hours or --failures-per-1000-node-days, not both")
    if args.mtbf_hours is not None:
        if not (math.isfinite(args.mtbf_hours) and args.mtbf_hours > 0):
            raise ConfigError(f"--mtbf-hours must be > 0, got {args.mtbf_hours}")
        rate = 1.0 / (args.mtbf_hours * cluster.gpus)
        failures = FailureModel((FailureCause("failure", rate, "gpu-hour", "node"),))
        source = f"failures: --mtbf-hours {args.mtbf_hours:g}; costs: preset {sc.name}"
    if args.node_rate is not None:
        failures = FailureModel(
            (FailureCause("node failure", args.node_rate / 1000.0, "node-day", "node"),)
        )
        source = (
            f"failures: --failures-per-1000-node-days {args.node_rate:g}; costs: preset {sc.name}"
        )
    return failures, source


def _job_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The job's fields the flags set (checkpoint size and speed, stalls, async, interval)."""
    job: dict[str, Any] = {}
    if (args.ckpt_bytes is None) != (args.write_gbps is None):
        raise ConfigError("--ckpt-bytes and --write-gbps go together; give both or neither")
    if args.ckpt_bytes is not None:
        if not (math.isfinite(args.write_gbps) and args.write_gbps > 0):
            raise ConfigError(f"--write-gbps must be > 0, got {args.write_gbps}")
        save = parse_bytes(args.ckpt_bytes) / (args.write_gbps * 1e9)
        job.update(sync_save_s=save, persist_s=save)
    for flag in ("sync_save_s", "snapshot_stall_s", "persist_s", "async_penalty"):
        if getattr(args, flag) is not None:
            job[flag] = getattr(args, flag)
    if args.async_group_nodes is not None:
        job["async_group_nodes"] = args.async_group_nodes
    if args.interval_min is not None:
        job["interval_s"] = args.interval_min * 60.0
    return job


def replica_count(args: argparse.Namespace) -> int:
    n = args.replicas if args.replicas is not None else args.replicas_default
    if n < 2:
        raise ConfigError(f"--replicas must be >= 2 (confidence intervals need two), got {n}")
    return int(n)
