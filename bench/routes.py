"""Routes benchmark: `stalwart compare` on a 4-worker job, sized so that every faulted
route meets at least ``--faults F`` faults of its trace (issue 34).

One corpus script (examples/corpus/nanogpt.py, a small GPT) runs to the same step count
under torchrun --max-restarts with nanoGPT's torch.save resume, under stalwart's restart,
flash, spare, elastic and async, and under torchft (its lighthouse and a torchrun per
replica group over the script's torchft port, when torchft is installed: ``pip install
'.[bench]'``; otherwise one line saying why), each faulted and fault-free, with the same
recorded fault instants.

Sized by faults, not by steps: a short warm-up (the plain script under torchrun,
``--warmup-steps``) measures this machine's seconds per step; the trace (``--trace``,
compiled here with ``--seed`` and handed to compare as a file: every route replays it)
gives the instant of its F-th fault; the job gets the steps that take ``SAFETY`` x that
long at the warm-up's rate, so a route meets >= F faults whatever the machine's speed
(``--steps`` overrides the sizing). A
route that met fewer than F faults (or did not reach its target) is marked invalid with
the reason and left out of "best"; a run none of whose routes is valid prints
``"valid": false`` and no best route.

Per route the final JSON line keeps compare's figures (``ettr``, ``time_to_target_s``,
``fault_free_s``, ``rto_p50_s``, ``rto_p95_s``: the per-fault RTO over the >= F faults,
``utilisation``, ``loss_gap``, ``faults``, ...: docs/routes.md) and adds ``badput`` (1 -
ETTR), ``lost_s`` (the time lost to faults: (1 - ETTR) x time to target, from the faulted
run alone), ``extra_vs_fault_free_s`` (time to target less the fault-free run's: two runs,
so it moves with the load), ``lost_per_fault_s``, and ``lost_vs_torchrun`` /
``lost_vs_torchft`` (its lost time over the peer's, same comparison): total time against
torchrun's depends mostly on how fast torchrun restarts on the machine, the lost time on
the route itself. The harness (bench/_harness.py)
adds ``spread``, ``valid``, the load, versions and machine; ``--reps`` repeats the whole
comparison (default 1: the spread of a route comes from its faults, p50 and p95).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import Invalid, Summary, add_arguments, fault_shortfall, repeat  # noqa: E402

from stalwart.chaos.trace import FaultTrace, compile_trace, load_trace  # noqa: E402
from stalwart.errors import ConfigError  # noqa: E402
from stalwart.metrics.routes import read_step_records  # noqa: E402

SCRIPT = HERE.parent / "examples" / "corpus" / "nanogpt.py"
WORKERS = 4
DAY_S = 86400.0  # the trace compiled over a day to find its F-th fault
SAFETY = 1.5  # the job's planned span over the F-th fault's instant (routes differ in pace)
PEERS = ("torchrun", "torchft")
KEYS = (
    "ettr", "time_to_target_s", "fault_free_s", "rto_p50_s", "rto_p95_s", "utilisation",
    "loss_gap", "faults", "recovered", "steps_lost", "sim_predicted_ettr",
    "sim_measured_ettr", "planned", "met_faults",
)  # fmt: skip


class SizingError(RuntimeError):
    """The job cannot be sized by faults (a trace with fewer faults than asked, a warm-up
    that recorded no steps)."""


def warm_up(steps: int, work: Path) -> float:
    """Seconds per step of the plain script under torchrun here, evals included (the
    span of member 0's step records over the steps between them)."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(WORKERS), str(SCRIPT), "--plain"]
    cmd += ["--max_iters", str(steps), "--eval_interval", "25", "--out", str(work)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return _step_rate(read_step_records(work / "trace-m0.jsonl"))


def _step_rate(recs: Sequence[Any]) -> float:
    if len(recs) < 3:
        raise SizingError(f"the warm-up recorded {len(recs)} steps; raise --warmup-steps")
    first = recs[1]  # the first step holds the compile and the first batch
    return (recs[-1].t - first.t) / (recs[-1].step - first.step)


def size_steps(spec: str, seed: int, faults: int, step_s: float) -> tuple[int, FaultTrace]:
    """(steps, the trace every route replays): the steps that take ``SAFETY`` x the F-th
    fault's instant at ``step_s`` per step, found on the trace compiled over a day; the
    trace replayed is compiled again over the horizon such a job needs (:func:`horizon_s`,
    as compare would) and handed to compare as a file, so the instants sized here are
    the ones every route meets (a multi-clause trace's depend on its horizon: sized on
    both, the larger kept)."""

    def steps_for(trace: FaultTrace, over: str) -> int:
        instants = sorted(f.t_s for f in trace.faults)
        if len(instants) < faults:
            raise SizingError(
                f"the trace {spec!r} has {len(instants)} faults in {over}, fewer than "
                f"--faults {faults}; give a repeating trace (kill every=15s) or lower --faults"
            )
        return max(50, math.ceil(SAFETY * instants[faults - 1] / step_s))

    steps = steps_for(compile_trace(spec, seed=seed, ranks=WORKERS, horizon_s=DAY_S), "a day")
    horizon = horizon_s(steps, step_s)
    trace = compile_trace(spec, seed=seed, ranks=WORKERS, horizon_s=horizon)
    return max(steps, steps_for(trace, f"{horizon:.0f} s")), trace


def horizon_s(steps: int, step_s: float) -> float:
    """Seconds of trace for a job of ``steps``: 8x its fault-free span (faults and a
    loaded machine lengthen it), 600 at least."""
    return max(600.0, 8 * steps * step_s)


def run_compare(cmd: list[str]) -> dict[str, Any]:
    """Run ``stalwart compare --json``, its progress shown as it comes; its document."""
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if lines:
                print(lines[-1], flush=True)
            lines.append(line.rstrip("\n"))
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"stalwart compare exited {proc.returncode}")
    doc: dict[str, Any] = json.loads(lines[-1])
    return doc


def _lost(row: dict[str, Any]) -> float | None:
    """Time lost to faults, from the faulted run alone (as ETTR, so the load drifting
    between a route's two runs does not move it): (1 - ETTR) x its time to target, its
    startup counted in (a small overestimate: (1 - ETTR) x the startup)."""
    ttt, ettr = row.get("time_to_target_s"), row.get("ettr")
    return None if ttt is None or ettr is None else float((1.0 - ettr) * ttt)


def _extra(row: dict[str, Any]) -> float | None:
    """Time to target less the fault-free run's (two runs: moves with the load)."""
    ttt, free = row.get("time_to_target_s"), row.get("fault_free_s")
    return None if ttt is None or free is None else float(ttt - free)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def route_rows(doc: dict[str, Any], faults: int) -> dict[str, Any]:
    """One repetition's figures from compare's document: per route compare's keys plus
    badput and lost time, and an :class:`Invalid` per route short of ``faults`` faults
    or of its target."""
    rows: dict[str, dict[str, Any]] = {}
    invalid: list[Invalid] = []
    for name, row in doc["routes"].items():
        out = {k: row.get(k) for k in KEYS}
        ettr, lost = row.get("ettr"), _lost(row)
        out["badput"] = None if ettr is None else 1.0 - ettr
        out["lost_s"] = lost
        out["extra_vs_fault_free_s"] = _extra(row)
        out["lost_per_fault_s"] = _ratio(lost, row.get("faults"))
        out["note"] = row.get("note", "")
        rows[name] = out
        short = fault_shortfall(f"routes.{name}", row.get("faults"), faults)
        if short is not None:
            invalid.append(short)
        elif row.get("time_to_target_s") is None:
            why = row.get("note") or "no time to target"
            invalid.append(Invalid(f"routes.{name}", f"routes.{name}: {why}"))
        _say(name, row)
    short_of = {inv.prefix for inv in invalid}
    for name, out in rows.items():  # against a peer's lost time only where it met its faults
        for peer in PEERS:
            if name != peer and peer in rows and f"routes.{peer}" not in short_of:
                out[f"lost_vs_{peer}"] = _ratio(out["lost_s"], rows[peer]["lost_s"])
    return {"routes": rows, "absent": doc.get("absent", {}), "_invalid": invalid}


def _say(name: str, row: dict[str, Any]) -> None:
    if row.get("note"):
        print(f"{name}: {row['note']}", flush=True)
    pred, meas = row.get("sim_predicted_ettr"), row.get("sim_measured_ettr")
    if pred is not None and meas is not None:
        print(
            f"sim {name}: predicted ETTR {pred:.3f}, measured {meas:.3f} "
            f"({100 * (pred - meas):+.1f} points)"
        )


def verdicts(summary: Summary, names: Sequence[str]) -> dict[str, Any]:
    """The best stalwart route by time to target, among the valid ones only (torchrun and
    torchft are the peers, never "ours"), against its fault-free time, torchrun's, and its
    lost time against the peers'. Empty when no route is valid."""
    ttt = {n: summary.figure(f"routes.{n}.time_to_target_s") for n in names if n not in PEERS}
    ours = {n: t for n, t in ttt.items() if t is not None}
    if not ours:
        return {}
    best = min(ours, key=lambda n: ours[n])
    fig = summary.figure
    out: dict[str, Any] = {"best": best, "best_ettr": fig(f"routes.{best}.ettr")}
    out["best_badput"] = fig(f"routes.{best}.badput")
    out["best_vs_fault_free"] = _ratio(ours[best], fig(f"routes.{best}.fault_free_s"))
    out["best_vs_torchrun"] = _ratio(ours[best], fig("routes.torchrun.time_to_target_s"))
    for peer in PEERS:
        out[f"best_lost_vs_{peer}"] = _ratio(
            fig(f"routes.{best}.lost_s"), fig(f"routes.{peer}.lost_s")
        )
    return {k: v for k, v in out.items() if v is not None}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--faults", type=int, default=5, help="faults every faulted route must meet")
    p.add_argument("--steps", type=int, default=None, help="fixed size: no sizing by faults")
    p.add_argument("--step-s", type=float, default=None, help="seconds per step: no warm-up")
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument(
        "--trace",
        default="kill every=15s",
        help="the fault trace every route replays (15 s apart: 5 faults fit in 75 s, so the "
        "seven routes' 14 runs take about half an hour here)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routes", default="torchrun,restart,flash,spare,elastic,async,torchft")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--reuse",
        action="store_true",
        help="with --out and --steps: the runs, warm-up and trace in --out (compare --reuse)",
    )
    add_arguments(p, default_reps=1)
    return p


def _command(
    steps: int, step_s: float, trace: Path, routes: str, out: Path, reuse: bool = False
) -> list[str]:
    cmd = [sys.executable, "-m", "stalwart.cli.main", "compare", "--json"]
    cmd += ["--reuse"] if reuse else []
    cmd += ["--nproc-per-node", str(WORKERS), "--target", str(steps), "--trace", str(trace)]
    cmd += ["--routes", routes, "--out", str(out), "--persist-every", "25"]
    cmd += ["--timeout", str(6 * steps * step_s + 300)]
    return [*cmd, str(SCRIPT), "--max_iters", str(steps), "--eval_interval", "25"]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.faults < 1:
        print("bench/routes.py: --faults takes a positive count (5 by default)")
        return 2
    if args.reuse and not (args.out and args.steps):
        print("bench/routes.py: --reuse takes the --out and --steps of the run to reuse")
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="stalwart-bench-routes-"))
    try:
        if args.reuse:
            step_s = args.step_s or _step_rate(
                read_step_records(out / "warm-up" / "trace-m0.jsonl")
            )
        else:
            step_s = args.step_s or warm_up(args.warmup_steps, out / "warm-up")
        return _run(args, out, step_s)
    except (SizingError, subprocess.SubprocessError, ConfigError) as exc:
        print(json.dumps({"error": f"bench/routes.py: {exc}", "valid": False}))
        return 2


def _run(args: argparse.Namespace, out: Path, step_s: float) -> int:
    sized: dict[str, Any] = {"step_s": round(step_s, 4), "faults_asked": args.faults}
    if args.steps:
        steps, by = args.steps, "--steps"
        horizon = horizon_s(steps, step_s)
        trace = compile_trace(args.trace, seed=args.seed, ranks=WORKERS, horizon_s=horizon)
        if args.reuse:  # the trace the runs in --out met, whatever it was sized on
            trace, by = load_trace(out / "trace.json"), "faults (runs reused)"
    else:
        steps, trace = size_steps(args.trace, args.seed, args.faults, step_s)
        by = "faults"
    out.mkdir(parents=True, exist_ok=True)
    trace.to_file(out / "trace.json")  # the trace every route and repetition replays
    sized |= {"sized_by": by, "trace": trace.spec, "trace_faults": len(trace.faults)}
    print(f"routes: {steps} steps at {step_s:.3f} s/step (sized by {by})", flush=True)
    names = [n for n in args.routes.split(",") if n]

    def measure(rep: int) -> dict[str, Any]:
        cmd = _command(
            steps, step_s, out / "trace.json", args.routes, out / f"rep{rep}", args.reuse
        )
        doc = run_compare(cmd)
        return route_rows(doc, args.faults)

    summary = repeat(measure, args.reps)
    extra = {"steps": steps, **sized, **verdicts(summary, names), "work_dir": str(out)}
    print(json.dumps(summary.document(extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
