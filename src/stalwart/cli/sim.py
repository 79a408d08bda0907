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
from pathlib import Path
from typing import Any

from stalwart.cli._calibrate import register_calibrate
from stalwart.cli._sim_scenario import (
    add_scenario_flags,
    build_scenario,
    parse_bytes,
    replica_count,
)
from stalwart.cli._sim_text import clean, header, minutes, table

__all__ = ["parse_bytes", "register"]

_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def register(subparsers: Any) -> None:
    """Add ``plan``, ``simulate`` and ``calibrate`` to the ``stalwart`` command."""
    plan = subparsers.add_parser(
        "plan",
        help="optimal checkpoint intervals (Young, Daly, simulated) and ETTR per strategy",
        description="Optimal snapshot and persist intervals and expected ETTR per strategy.",
    )
    add_scenario_flags(plan)
    plan.set_defaults(func=_cmd_plan, replicas_default=64)
    sim = subparsers.add_parser(
        "simulate",
        help="Monte Carlo of a job on a failing cluster, every recovery strategy side by side",
        description="Monte Carlo comparison of recovery strategies, with 95% confidence intervals.",
    )
    add_scenario_flags(sim)
    sim.set_defaults(func=_cmd_simulate, replicas_default=200)
    register_calibrate(subparsers)


def _cmd_plan(args: argparse.Namespace) -> int:
    from stalwart.sim import parse_strategies
    from stalwart.sim.planner import plan

    sc = build_scenario(args)
    strategies = parse_strategies(args.strategy)
    replicas = replica_count(args)
    result = plan(sc, strategies, replicas=replicas, seed=args.seed)
    plots = []
    if args.out:
        from stalwart.sim.plots import plot_ettr_vs_interval

        plots.append(str(plot_ettr_vs_interval(result, Path(args.out) / "plan_interval.png")))
    if args.json:
        doc = dataclasses.asdict(result)
        doc["plots"] = plots
        print(json.dumps(clean(doc)))
        return 0
    print(header(sc, replicas))
    rows = [
        [
            s.strategy,
            f"{s.stall_s:g}",
            minutes(s.young_s),
            minutes(s.daly_s),
            minutes(s.optimum_s),
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
    print(table(heads, rows))
    for p in plots:
        print(f"wrote {p}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from stalwart.sim import parse_strategies, simulate

    sc = build_scenario(args)
    strategies = parse_strategies(args.strategy)
    replicas = replica_count(args)
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
        print(json.dumps(clean(doc)))
        return 0
    print(header(sc, replicas))
    print(f"failures per run: {result.events / result.replicas:.1f}")
    rows = [
        [
            r.strategy,
            minutes(r.interval_s),
            f"{100 * r.ettr:.2f} +- {100 * r.ettr_ci95:.2f}",
            f"{r.rto_s:.0f}",
            f"{100 * r.idle_share:.1f}",
            f"{r.lost_h:.1f}",
            r.note,
        ]
        for r in result.results
    ]
    heads = ["strategy", "interval min", "ETTR %", "RTO s", "idle %", "lost h", "quality"]
    print(table(heads, rows))
    for p in plots:
        print(f"wrote {p}")
    return 0
