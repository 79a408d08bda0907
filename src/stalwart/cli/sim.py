"""``stalwart plan``, ``stalwart simulate`` and ``stalwart calibrate``: the checkpoint planner,
the cluster simulator, and the calibration of its costs from a real run's event log.

Both start from a preset (``--preset``, default ``llama3-54d``), apply a calibration file if
given, then the flags; they print a table (or one JSON object with ``--json``) and write PNG plots
under ``--out DIR`` when asked. Flags always win over the preset and the calibration; no
environment variable changes anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from stalwart.errors import ConfigError

__all__ = ["parse_bytes", "register"]

_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
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


def _common(p: argparse.ArgumentParser) -> None:
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


def register(subparsers: Any) -> None:
    """Add ``plan`` and ``simulate`` to the ``stalwart`` command."""
    plan = subparsers.add_parser(
        "plan",
        help="optimal checkpoint intervals (Young, Daly, simulated) and ETTR per strategy",
        description="Optimal snapshot and persist intervals and expected ETTR per strategy.",
    )
    _common(plan)
    plan.set_defaults(func=_cmd_plan, replicas_default=64)
    sim = subparsers.add_parser(
        "simulate",
        help="Monte Carlo of a job on a failing cluster, every recovery strategy side by side",
        description="Monte Carlo comparison of recovery strategies, with 95% confidence intervals.",
    )
    _common(sim)
    sim.set_defaults(func=_cmd_simulate, replicas_default=200)
    cal = subparsers.add_parser(
        "calibrate",
        help="measure a run's costs from its event log and write a calibration file",
        description=(
            "Read RUN_DIR/events.jsonl (a `stalwart run`), measure step time, snapshot stall, "
            "persist, detection latency per fault kind, recovery per strategy and restore per "
            "tier, and write a calibration file for `stalwart plan|simulate --calibration`. "
            "Also replays the run in the simulator and prints predicted vs measured ETTR."
        ),
    )
    cal.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or its events.jsonl)")
    cal.add_argument(
        "--out", metavar="FILE", help="where to write it (default RUN_DIR/calibration.json)"
    )
    cal.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    cal.set_defaults(func=_cmd_calibrate)


def _scenario(args: argparse.Namespace) -> Any:
    from stalwart.sim import ClusterConfig, FailureCause, FailureModel, preset
    from stalwart.sim.calibration import apply_calibration, load_calibration

    sc = preset(args.preset)
    if args.calibration:
        sc = apply_calibration(sc, load_calibration(args.calibration))
    cluster = sc.cluster
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
    cluster = ClusterConfig(**{**dataclasses.asdict(cluster), **changes})
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
    fchanges: dict[str, Any] = {}
    if args.distribution is not None:
        fchanges["distribution"] = args.distribution
    if args.weibull_shape is not None:
        fchanges["weibull_shape"] = args.weibull_shape
    failures = dataclasses.replace(failures, **fchanges)
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
        job=dataclasses.replace(sc.job, **job),
        costs=dataclasses.replace(sc.costs, **costs),
        horizon_s=horizon,
        source=source,
    )


def _replicas(args: argparse.Namespace) -> int:
    n = args.replicas if args.replicas is not None else args.replicas_default
    if n < 2:
        raise ConfigError(f"--replicas must be >= 2 (confidence intervals need two), got {n}")
    return int(n)


def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN and inf become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60.0:.2f}"


def _header(sc: Any, replicas: int) -> str:
    days = sc.horizon_s / 86400.0
    return (
        f"{sc.name}: {sc.cluster.gpus:,} GPUs ({sc.cluster.nodes:,} nodes, "
        f"{sc.cluster.spare_nodes} spares), {days:g} days, MTBF {sc.mtbf_s / 3600.0:.2f} h, "
        f"{sc.failures.distribution} failures, {replicas} replicas\nsource: {sc.source or '-'}"
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from stalwart.sim import parse_strategies
    from stalwart.sim.planner import plan

    sc = _scenario(args)
    strategies = parse_strategies(args.strategy)
    replicas = _replicas(args)
    result = plan(sc, strategies, replicas=replicas, seed=args.seed)
    plots = []
    if args.out:
        from stalwart.sim.plots import plot_ettr_vs_interval

        plots.append(str(plot_ettr_vs_interval(result, Path(args.out) / "plan_interval.png")))
    if args.json:
        doc = dataclasses.asdict(result)
        doc["plots"] = plots
        print(json.dumps(_clean(doc)))
        return 0
    print(_header(sc, replicas))
    rows = [
        [
            s.strategy,
            f"{s.stall_s:g}",
            _minutes(s.young_s),
            _minutes(s.daly_s),
            _minutes(s.optimum_s),
            str(s.persist_every),
            f"{100 * s.ettr:.2f} +- {100 * s.ettr_ci95:.2f}",
        ]
        for s in result.strategies
    ]
    heads = [
        "strategy",
        "stall s",
        "Young min",
        "Daly min",
        "optimum min",
        "persist every",
        "ETTR %",
    ]
    print(_table(heads, rows))
    for p in plots:
        print(f"wrote {p}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from stalwart.sim import parse_strategies, simulate

    sc = _scenario(args)
    strategies = parse_strategies(args.strategy)
    replicas = _replicas(args)
    result = simulate(sc, strategies, replicas=replicas, seed=args.seed)
    plots = []
    if args.out:
        from stalwart.sim.planner import ettr_vs_scale, plan
        from stalwart.sim.plots import plot_ettr_vs_interval, plot_ettr_vs_scale

        out = Path(args.out)
        grid = plan(sc, strategies, replicas=min(replicas, 64), seed=args.seed)
        plots.append(str(plot_ettr_vs_interval(grid, out / "ettr_vs_interval.png")))
        sizes = tuple(g for g in _SIZES if g % sc.cluster.gpus_per_node == 0)
        scale = ettr_vs_scale(sc, strategies, sizes, replicas=min(replicas, 32), seed=args.seed)
        plots.append(str(plot_ettr_vs_scale(scale, sc.name, out / "ettr_vs_scale.png")))
    if args.json:
        doc = dataclasses.asdict(result)
        doc["source"] = sc.source
        doc["plots"] = plots
        print(json.dumps(_clean(doc)))
        return 0
    print(_header(sc, replicas))
    print(f"failures per run: {result.events / result.replicas:.1f}")
    rows = [
        [
            r.strategy,
            _minutes(r.interval_s),
            f"{100 * r.ettr:.2f} +- {100 * r.ettr_ci95:.2f}",
            f"{r.rto_s:.0f}",
            f"{100 * r.idle_share:.1f}",
            f"{r.lost_h:.1f}",
            r.note,
        ]
        for r in result.results
    ]
    heads = ["strategy", "interval min", "ETTR %", "RTO s", "idle %", "lost h", "quality"]
    print(_table(heads, rows))
    for p in plots:
        print(f"wrote {p}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import os
    import sys

    from stalwart.sim.calibrate import calibrate, replay
    from stalwart.sim.calibration import calibration_to_dict

    run = calibrate(args.run_dir)
    cal = run.calibration
    doc = calibration_to_dict(cal)
    if args.out:
        out = Path(args.out)
    else:
        base = Path(args.run_dir)
        out = (base if base.is_dir() else base.parent) / "calibration.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(_clean(doc), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except OSError as err:
        raise ConfigError(f"cannot write {out}: {err.strerror}; pass --out FILE") from err
    warnings = list(run.warnings)
    if run.missing:
        warnings.append(
            "not measured by this run (the preset's values stay): " + ", ".join(run.missing)
        )
    rep = replay(cal) if cal.replay is not None else None
    if args.json:
        print(
            json.dumps(
                _clean(
                    {
                        "file": str(out),
                        "calibration": doc,
                        "samples": {k: run.counts.get(k, 0) for k in cal.costs},
                        "missing": run.missing,
                        "warnings": warnings,
                        "replay": None
                        if rep is None
                        else {
                            "strategy": rep.strategy,
                            "predicted_ettr": rep.predicted_ettr,
                            "measured_ettr": rep.measured_ettr,
                            "error_pp": rep.error_pp,
                            "interval_s": rep.interval_s,
                            "failures": rep.failures,
                        },
                    }
                )
            )
        )
        return 0
    for w in warnings:
        print(f"stalwart: warning: {w}", file=sys.stderr)
    m = cal.measured
    head = f"calibrated {cal.source.get('run_dir')} ({cal.source.get('events')} events"
    if m is not None:
        head += (
            f", strategy {cal.source.get('strategy')}, {m.gpus} GPUs on {m.nodes} node(s), "
            f"{m.failures} failure(s), wall {m.wall_s:.1f}s"
        )
    print(head + ")")
    rows = [[k, f"{v:.4g}", str(run.counts.get(k, 0))] for k, v in cal.costs.items()]
    if rows:
        print(_table(["cost", "seconds", "samples"], rows))
    if m is not None:
        extra = []
        if m.step_s is not None:
            extra.append(f"step {1000 * m.step_s:.1f} ms")
        if m.mtbf_s is not None:
            extra.append(f"MTBF {m.mtbf_s:.1f}s")
        if m.persist_bytes_per_s is not None:
            extra.append(f"persist {m.persist_bytes_per_s / 1e6:.1f} MB/s")
        print(f"measured: ETTR {100 * m.ettr:.1f}%  " + "  ".join(extra))
    if rep is not None:
        pp = rep.error_pp
        print(
            f"replay ({rep.strategy}, {rep.failures} failure(s) at the run's steps/times, "
            f"checkpoint every {rep.interval_s:.3g}s): predicted ETTR "
            f"{100 * rep.predicted_ettr:.1f}%"
            + ("" if pp is None else f" vs measured {100 * (rep.measured_ettr or 0):.1f}%")
            + ("" if pp is None else f" ({pp:+.1f} pp)")
        )
    print(f"wrote {out}")
    return 0
