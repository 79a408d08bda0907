"""``stalwart compare SCRIPT``: one job, one fault trace, every recovery route, one table.

Why a command and not only a benchmark: "which route should my job use" is answered by
the user's own script on the user's own machine, with the same faults for every route
(the trace is compiled once, recorded in OUT/trace.json, and replayed), and each route
judged against its own fault-free run. Figures and their definitions:
:mod:`stalwart.metrics.routes`, docs/routes.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

from stalwart.chaos.trace import FaultTrace, compile_trace, load_trace
from stalwart.cli._compare_run import Route, RunSettings, load_route, run_route, term_exits
from stalwart.cli._compare_sim import simulate_injected, simulate_route
from stalwart.cli._torchft_launch import lighthouse_binary
from stalwart.contract.env import Strategy
from stalwart.errors import ConfigError
from stalwart.metrics.routes import (
    RouteFigures,
    RouteRun,
    compare_document,
    faults_met,
    kept_losses,
    route_figures,
)
from stalwart.metrics.routes_render import routes_html, routes_markdown

__all__ = ["ROUTE_NAMES", "register"]

ROUTE_NAMES = ("torchrun", "restart", "flash", "spare", "elastic", "async", "torchft")


def register(subparsers: Any) -> None:
    """Add ``compare`` to the ``stalwart`` command."""
    p = subparsers.add_parser(
        "compare",
        help="run one script under every recovery route with the same faults; one table",
        description=(
            "Runs SCRIPT (a corpus-style script that records its steps: examples/corpus/) "
            "fault-free and under one fault trace with each route: torchrun --max-restarts "
            "with the script's torch.save resume, stalwart restart, flash, spare, elastic "
            "(async and torchft where available), and writes OUT/routes.md, routes.json "
            "and routes.html: time to the target, ETTR, utilisation, RTO, steps lost, the "
            "loss gap to the fault-free run and the simulator's replay (docs/routes.md)."
        ),
    )
    p.add_argument("script", help="the training script (e.g. examples/corpus/nanogpt.py)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments, after --")
    p.add_argument("--trace", default="kill every=20s", help="a trace spec or a trace file")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace's instants and ranks")
    p.add_argument("--horizon", type=float, default=900.0, help="seconds of trace to compile")
    p.add_argument("--target", type=int, required=True, help="the step the script ends at")
    p.add_argument("--nproc-per-node", type=int, default=4, help="workers")
    p.add_argument("--routes", default=",".join(ROUTE_NAMES), help="comma-separated routes")
    p.add_argument(
        "--persist-every",
        type=int,
        default=25,
        help="restart's --persist-every, and torchrun's save cadence for the simulator "
        "(match the script's own: nanogpt.py saves every --eval_interval)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="longest one run may take (s)")
    p.add_argument(
        "--cap",
        type=float,
        default=3.0,
        help="a faulted run is stopped at this many times its fault-free time (not reached)",
    )
    p.add_argument("--out", default="runs/compare", help="folder for the runs and the table")
    p.add_argument(
        "--torchrun-args",
        default="--plain --init_from resume --always_save_checkpoint",
        help="script arguments of the torchrun route (its plain mode and resume)",
    )
    p.add_argument(
        "--elastic-args",
        default="--data epoch --schedule cosine --batch_size 2 --gradient_accumulation_steps 3",
        help="script arguments of the elastic route: its resharding data and schedule, and "
        "a global batch (2 x 3 x 4 = 24) that every size of W-1:W divides",
    )
    p.add_argument(
        "--torchft-args",
        default="--torchft",
        help="script arguments of the torchft route (its torchft port: a Manager per "
        "replica group of one worker, a lighthouse; stalwart.cli._torchft_launch)",
    )
    p.add_argument(
        "--async-args",
        default="--replica-groups 2 --sync-every 20",
        help="`stalwart run` flags of the async route (docs/async.md)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="take a run already in OUT (its observed.json) instead of running it again: an "
        "interrupted comparison goes on, and a table is made anew from the runs it has",
    )
    p.add_argument("--json", action="store_true", help="print the document as one JSON line")
    p.set_defaults(func=_cmd_compare)


def _routes(args: argparse.Namespace) -> tuple[list[Route], dict[str, str]]:
    """The routes to run, and those asked for that cannot run here (with why)."""
    w, names = args.nproc_per_node, [n.strip() for n in args.routes.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROUTE_NAMES]
    if unknown:
        raise ConfigError(f"--routes: unknown {', '.join(unknown)}; use {', '.join(ROUTE_NAMES)}")
    plain = tuple(shlex.split(args.torchrun_args))
    table = {
        "torchrun": Route("torchrun", "torchrun", extra_args=plain),
        "restart": Route("restart", "stalwart", "restart"),
        "flash": Route("flash", "stalwart", "flash"),
        "spare": Route("spare", "stalwart", "spare", spares=1),
        "elastic": Route(
            "elastic", "stalwart", "elastic", nproc=f"{max(w - 1, 1)}:{w}",
            extra_args=tuple(shlex.split(args.elastic_args)),
        ),
    }  # fmt: skip
    absent: dict[str, str] = {}
    try:
        launcher = tuple(shlex.split(args.async_args))
        table["async"] = Route("async", "stalwart", str(Strategy("async")), launcher_args=launcher)
    except ValueError:
        absent["async"] = "not built on this main (--strategy async is not a strategy here)"
    if importlib.util.find_spec("torchft") is None or lighthouse_binary() is None:
        absent["torchft"] = "torchft is not installed (pip install '.[bench]')"
    else:
        ft_args = tuple(shlex.split(args.torchft_args))
        table["torchft"] = Route("torchft", "torchft", extra_args=ft_args)
    return [table[n] for n in names if n in table], {n: absent[n] for n in names if n in absent}


def _trace(args: argparse.Namespace) -> FaultTrace:
    if os.path.exists(args.trace):  # a FIFO or device too: load_trace refuses it
        return load_trace(args.trace)
    return compile_trace(
        args.trace, seed=args.seed, ranks=args.nproc_per_node, horizon_s=args.horizon
    )


def _run_pair(
    route: Route, st: RunSettings, trace: FaultTrace, reuse: bool
) -> tuple[RouteRun, RouteRun]:
    label = f"{route.name}/fault-free"
    free = load_route(route, st, None, label) if reuse else None
    print(f"{route.name}: fault-free run{' (reused)' if free else ''}", flush=True)
    free = free or run_route(route, st, None, label, st.timeout_s)
    print(f"{route.name}: fault-free {free.exited - free.launched:.1f}s exit {free.rc}", flush=True)
    _warn_outrun(route.name, trace, free.span_s)
    label = f"{route.name}/faulted"
    hit_or_none = load_route(route, st, trace, label) if reuse else None
    print(f"{route.name}: faulted run ({trace.spec}){' (reused)' if hit_or_none else ''}")
    cap = min(st.timeout_s, st.cap * (free.exited - free.launched))
    hit = hit_or_none or run_route(route, st, trace, label, cap)
    if route.injected:
        sim = simulate_injected(hit, free, route.launcher, st.persist_every)
    else:
        sim = simulate_route(st.work / f"{route.name}-faulted")
    hit = RouteRun(**{**hit.__dict__, "sim": sim})
    met = faults_met(hit.planned_at, len(hit.faults_at), hit.span_s)
    said = f": {met.note}" if met.note else ""
    print(
        f"{route.name}: faulted {hit.exited - hit.launched:.1f}s exit {hit.rc}, "
        f"{met.fired} of {met.planned} faults fired{said}",
        flush=True,
    )
    return free, hit


def _warn_outrun(name: str, trace: FaultTrace, span_s: float | None) -> None:
    """Say before the faulted run when its fault-free run's steps ended before the trace's
    first instant: on this machine the job may outrun its faults (a fault-free run then)."""
    if trace.faults and span_s is not None and trace.faults[0].t_s > span_s:
        print(
            f"{name}: the trace's first fault is due {trace.faults[0].t_s:.1f} s after the "
            f"first step, past the {span_s:.1f} s the fault-free run's steps took: the "
            "faulted run may end before it (raise --target, or start the trace earlier)",
            flush=True,
        )


def _cmd_compare(args: argparse.Namespace) -> int:
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"script {args.script!r} not found; give a path to a training script")
    if args.target < 1 or args.nproc_per_node < 1:
        raise ConfigError("--target and --nproc-per-node take positive integers")
    if not (args.cap >= 1.0 and args.timeout > 0):
        raise ConfigError("--cap takes a factor >= 1 and --timeout a positive number of seconds")
    routes, absent = _routes(args)
    trace = _trace(args)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    recorded = work / "trace.json"
    if args.reuse and recorded.is_file():
        kept = load_trace(recorded)
        if kept.faults != trace.faults:
            raise ConfigError(
                f"--reuse: {recorded} holds another trace ({kept.spec!r}, seed {kept.seed}); "
                f"give --trace {recorded} to reuse its runs, or a new --out"
            )
    trace.to_file(recorded)
    extra = [a for a in args.script_args if a != "--"]
    st = RunSettings(
        script.resolve(), tuple(extra), args.nproc_per_node, args.target, work,
        args.timeout, args.persist_every, args.cap,
    )  # fmt: skip
    print(f"compare: {len(routes)} routes, trace recorded in {work / 'trace.json'}", flush=True)
    rows: list[RouteFigures] = []
    curves: dict[str, list[tuple[int, float]]] = {}
    for route in routes:
        with term_exits():  # SIGTERM stops the route's processes, as Ctrl-C does
            free, hit = _run_pair(route, st, trace, args.reuse)
        rows.append(route_figures(hit, free))
        curves[route.name] = kept_losses(hit.records)
        curves[f"{route.name}/fault-free"] = kept_losses(free.records)
    job = {
        "script": script.name,
        "args": extra,
        "workers": args.nproc_per_node,
        "target": args.target,
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    doc = compare_document(job, trace.to_dict(), rows, curves, absent)
    (work / "routes.json").write_text(json.dumps(doc, indent=1) + "\n")
    (work / "routes.md").write_text(routes_markdown(doc))
    (work / "routes.html").write_text(routes_html(doc))
    print(routes_markdown(doc))
    print(f"wrote {work / 'routes.md'}, routes.json, routes.html")
    if args.json:
        print(json.dumps(doc))
    return 0
