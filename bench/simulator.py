"""Simulator speed: a 16,384-GPU, 54-day job, 200 Monte Carlo replicas, every strategy.

Measures the wall time of ``stalwart.sim.simulate`` (sampling the failures included) on the
``llama3-54d`` preset, then the same at other cluster sizes to show that the cost follows the
number of failures, not the number of GPUs. Prints a table and, last, one JSON line with
``gpus, days, replicas, seconds, events_per_s`` for the headline configuration, where
``events_per_s`` counts failures replayed per second summed over the strategies.

    .venv/bin/python bench/simulator.py [--gpus 16384] [--days 54] [--replicas 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from stalwart.errors import StalwartError
from stalwart.sim import STRATEGIES, preset, simulate
from stalwart.sim.planner import scale_scenario


def _measure(gpus: int, days: float, replicas: int, seed: int) -> tuple[float, int, list[str]]:
    base = preset("llama3-54d")
    sc = scale_scenario(base, gpus)
    sc = sc.__class__(**{**sc.__dict__, "horizon_s": days * 86400.0})
    start = time.perf_counter()
    result = simulate(sc, STRATEGIES, replicas=replicas, seed=seed)
    seconds = time.perf_counter() - start
    ettrs = [f"{r.strategy} {100 * r.ettr:.1f}%" for r in result.results]
    return seconds, result.events, ettrs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=16384)
    parser.add_argument("--days", type=float, default=54.0)
    parser.add_argument("--replicas", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-scale", action="store_true", help="skip the other cluster sizes")
    args = parser.parse_args(argv)
    try:
        seconds, events, ettrs = _measure(args.gpus, args.days, args.replicas, args.seed)
        rows = [(args.gpus, seconds, events, ettrs)]
        if not args.no_scale:
            for gpus in (1024, 131072):
                rows.append((gpus, *_measure(gpus, args.days, args.replicas, args.seed)))
    except StalwartError as err:
        print(f"bench/simulator.py: error: {err}", file=sys.stderr)
        return 2
    n = len(STRATEGIES)
    print(f"{'GPUs':>8}  {'failures/run':>12}  {'seconds':>8}  {'events/s':>10}  ETTR per strategy")
    for gpus, secs, ev, ett in rows:
        per_run = ev / args.replicas
        print(
            f"{gpus:>8}  {per_run:>12.1f}  {secs:>8.3f}  {ev * n / secs:>10.0f}  {', '.join(ett)}"
        )
    line = {
        "gpus": args.gpus,
        "days": args.days,
        "replicas": args.replicas,
        "seconds": round(seconds, 4),
        "events_per_s": round(events * n / seconds),
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
