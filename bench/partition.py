"""Partition benchmark (issue 25): network faults between two hosts, per strategy and
coordinator backend, with what each cost and whether the job stayed consistent.

Hosts are network namespaces on a bridge (tests/hosts/_lab.py, the multi-host tests'
harness, imported from there: the cells and this bench inject the same faults from the
same spec); each fault starts once rank 0 reached the fault step. Needs root, iproute2,
nftables (and etcd for the etcd cells). The matrix, cell ``FAULT/STRATEGY/BACKEND``:

  FAULT     p3 / p30 / perm   both ways, healed after 3 s / 30 s / never
            oneway30          what host 1 sends to host 0 dropped for 30 s
            cp30              host 1 cut from the coordinator only for 30 s (node 0's
                              store, or etcd on a third host), the data plane intact
            loss30            30% of the packets between the hosts dropped for 30 s
            delay200          host 1's connections to the coordinator 200 ms late both
                              ways, from the job's start until 30 s after the fault step
                              (a userspace forwarder: new connections only, hence from
                              the start)
  STRATEGY  flash (examples/train_sharded.py) or elastic (examples/train_elastic.py);
            torchrun: the peer, torchrun's c10d rendezvous (bench/_partition_torchrun.py),
            stopped when still running --torchrun-cap seconds after the fault
  BACKEND   embedded (node 0's store) or etcd (a third host both nodes reach); c10d
            (torchrun's store on host 0) for torchrun

Per cell (times from the fault's injection, wall clock):
  detect_s      the first ``fault_detected`` event after it (None: none)
  recover_s     rank 0's first step in a generation newer than the one at the fault
                (None: the job never left its generation)
  gap_s         the longest gap between two of rank 0's steps from the fault step on,
                against the fault-free run's median step (``step_ms``)
  redone        steps rank 0 ran more than once
  split_brain   steps completed in a generation the job had left, past the one in
                flight at the bump (must be 0)
  refused       commits refused beyond the first of each process (a fenced member may
                see one and must stop; must be 0)
  rc1           the cut node's exit code (3: fenced; 0: rejoined or never cut)
  outcome       ok: node 0 ended 0, the result is the fault-free run's (flash: final
                parameters bit-identical; elastic: every step's samples and mean loss),
                split_brain and refused 0, nothing left in /dev/shm; else what differed

The reference of each stalwart strategy is its fault-free run in the same invocation
(one host, the same world size). Every fault of the chosen stalwart cells also runs
under torchrun (``FAULT/torchrun/c10d``, unless --no-torchrun): the final JSON line's
``partition_vs_torchrun`` compares each stalwart cell with torchrun under the same fault.
Prints a table and a final JSON line.

  python bench/partition.py                 p3/flash/embedded, perm/elastic/embedded and
                                            p3, perm under torchrun (10-15 minutes)
  python bench/partition.py --quick         p3/flash/embedded, p3/torchrun/c10d
  python bench/partition.py --all           all 35 cells (an hour or more)
  python bench/partition.py --cells 'p30/*/embedded,perm/elastic/etcd'
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _partition_torchrun import PORT as TORCHRUN_PORT
from _partition_torchrun import run_torchrun_cell
from hosts import _elastic as el
from hosts import _flash as fl
from hosts._etcd import CLIENT_PORT, etcd_on
from hosts._job import (
    STORE_PORT,
    HostJob,
    bumps,
    newest_checkpoint,
    old_generation_steps,
    refused_commits,
)
from hosts._lab import Lab, lab_missing

FAULTS = ["p3", "p30", "perm", "oneway30", "cp30", "loss30", "delay200"]
STRATEGIES = ["flash", "elastic"]
BACKENDS = ["embedded", "etcd"]
DEFAULT = ["p3/flash/embedded", "perm/elastic/embedded"]
QUICK = ["p3/flash/embedded"]
PEER = "torchrun/c10d"  # the peer's cells: FAULT/torchrun/c10d


def fault_spec(fault: str, backend: str) -> str:
    """The lab's spec for ``fault``; the coordinator is node 0's store, etcd on host 2, or
    torchrun's c10d store on host 0."""
    coord = {
        "embedded": f"1->0:{STORE_PORT}",
        "etcd": f"1->2:{CLIENT_PORT}",
        "c10d": f"1->0:{TORCHRUN_PORT}",
    }[backend]
    return {
        "p3": "partition 0<->1 for 3s",
        "p30": "partition 0<->1 for 30s",
        "perm": "partition 0<->1",
        "oneway30": "partition 1->0 for 30s",
        "cp30": f"partition {coord} for 30s",
        "loss30": "loss 0<->1 30% for 30s",
        "delay200": f"delay {coord.replace('->', '<->')} 200ms",
    }[fault]


@contextlib.contextmanager
def coordinator(lab: Lab, backend: str, work: Path) -> Iterator[str | None]:
    """None (node 0's embedded store) or the ``etcd://`` endpoint of etcd on host 2."""
    if backend == "embedded":
        yield None
        return
    (work / "etcd").mkdir(parents=True)
    with etcd_on(lab, 2, shutil.which("etcd") or "etcd", work / "etcd" / "data") as addr:
        yield f"etcd://{addr}/bench"


def rank0_steps(job: HostJob, strategy: str) -> list[tuple[int, float, int]]:
    """Rank 0's (step, time, generation), in time order."""
    if strategy == "flash":
        return job.steps()
    rows = [(int(r["step"]), float(r["t"]), int(r["gen"])) for r in el.trace(job) if r["rank"] == 0]
    return sorted(rows, key=lambda r: r[1])


def make_job(lab: Lab, work: Path, strategy: str, hosts: list[int], **kw: Any) -> HostJob:
    if strategy == "flash":
        return HostJob(lab, work, hosts, fl.ARGS, fl.FLAGS, **kw)
    return el.job_of(lab, work, hosts, flags=el.FLAGS, **kw)


def wait_fault_step(job: HostJob, strategy: str) -> None:
    if strategy == "flash":
        job.wait_step(fl.FAULT_AT, timeout=300)
    else:
        el.wait_traced(job, el.FAULT_AT, timeout=300)


def reference(strategy: str, work: Path) -> dict[str, Any]:
    """The fault-free run on one host: its result and median step time."""
    if strategy == "flash":
        with Lab(1) as lab:
            job = HostJob(lab, work, [0], fl.ARGS, fl.FLAGS, nproc=fl.WORLD)
            job.start()
            ended = job.wait(400)
        if [rc for rc, _ in ended] != [0]:
            raise RuntimeError(f"the fault-free flash run failed: {ended}")
        steps = job.steps()
        result: Any = job.digests()
    else:
        result = el.fault_free_trace(work)
        steps = sorted(
            (int(r["step"]), float(r["t"]), 0)
            for rs in result.values()
            for r in rs
            if r["rank"] == 0
        )
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(steps)]
    return {"result": result, "step_s": statistics.median(gaps)}


def run_cell(name: str, ref: dict[str, Any], root: Path, cap_s: float) -> dict[str, Any]:
    fault, strategy, backend = name.split("/")
    work = root / name.replace("/", "-")
    spec = fault_spec(fault, backend)
    if strategy == "torchrun":
        with Lab(2) as lab:
            return run_torchrun_cell(lab, spec, fault == "delay200", work, cap_s)
    with Lab(3 if backend == "etcd" else 2) as lab, coordinator(lab, backend, work) as rdzv:
        job = make_job(lab, work, strategy, [0, 1], rdzv=rdzv)
        heal = None
        try:
            if fault == "delay200":
                lab.inject(spec)
            job.start()
            wait_fault_step(job, strategy)
            t_fault = time.time()
            at = rank0_steps(job, strategy)
            gen_at = at[-1][2] if at else 0
            if fault == "delay200":
                heal = threading.Timer(30, lab.heal)
                heal.start()
            else:
                lab.inject(spec)
            ended = job.wait(420)
        finally:
            if heal is not None:
                heal.cancel()
            job.stop()
        shm = job.shm_left()
    for node, (_, err) in enumerate(ended):
        (work / f"node{node}.err").write_text(err)  # kept when the cell is not ok
    return measure(job, strategy, ended, ref, t_fault, gen_at, shm) | {"spec": spec}


def measure(
    job: HostJob,
    strategy: str,
    ended: list[tuple[int, str]],
    ref: dict[str, Any],
    t_fault: float,
    gen_at: int,
    shm: dict[str, list[str]],
) -> dict[str, Any]:
    events = []
    for path in sorted(job.run_dir.rglob("events*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    detected = [e["t"] for e in events if e.get("kind") == "fault_detected" and e["t"] >= t_fault]
    steps = rank0_steps(job, strategy)
    newer = [t for _, t, g in steps if g > gen_at and t >= t_fault]
    after = [t for s, t, _ in steps if t >= t_fault - 5 * ref["step_s"]]
    gaps = [b - a for a, b in itertools.pairwise(after)]
    refused = sum(len(v) - 1 for v in refused_commits(job.run_dir).values())
    (rc0, err0), (rc1, _) = ended
    why: list[str] = []
    if strategy == "flash":
        split = len(old_generation_steps(job))
        try:
            if job.digests() != ref["result"]:
                why.append("final parameters differ")
        except OSError:
            why.append("no final parameters")
        newest = {newest_checkpoint(job.run_dir, r) for r in range(fl.WORLD)}
        if newest != {fl.STEPS}:
            why.append(f"newest checkpoints {sorted(newest, key=str)}")
    else:
        recs = el.trace(job)
        split = len(el.old_generation_records(recs, job.run_dir))
        differ = el.compare(el.committed(recs), ref["result"])
        if differ:
            why.append(differ)
    if rc0 != 0:
        why.insert(0, f"node 0 rc {rc0}: {err0.strip().splitlines()[-1:]}")
    if split:
        why.append(f"{split} split-brain steps")
    if refused:
        why.append(f"{refused} refused commits")
    if shm:
        why.append(f"left in /dev/shm: {shm}")
    gen_events = bumps(job.run_dir) if strategy == "flash" else el.generations(job.run_dir)
    return {
        "detect_s": round(min(detected) - t_fault, 2) if detected else None,
        "recover_s": round(min(newer) - t_fault, 2) if newer else None,
        "gap_s": round(max(gaps), 2) if gaps else None,
        "step_ms": round(ref["step_s"] * 1000, 1),
        "redone": len(steps) - len({s for s, _, _ in steps}),
        "split_brain": split,
        "refused": refused,
        "rc0": rc0,
        "rc1": rc1,
        "generations": len(gen_events),
        "outcome": "ok" if not why else "; ".join(why),
    }


def select(args: argparse.Namespace) -> list[str]:
    every = [f"{f}/{s}/{b}" for f in FAULTS for s in STRATEGIES for b in BACKENDS]
    every += [f"{f}/{PEER}" for f in FAULTS]
    if args.all:
        return every
    if args.quick:
        return with_peer(QUICK, args)
    if not args.cells:
        return with_peer(DEFAULT, args)
    chosen = [c for c in every if any(fnmatch.fnmatch(c, p) for p in args.cells.split(","))]
    chosen = with_peer(chosen, args)
    if not chosen:
        raise SystemExit(
            f"--cells {args.cells!r} matches no cell: they are FAULT/STRATEGY/BACKEND, "
            f"FAULT one of {', '.join(FAULTS)}"
        )
    return chosen


def with_peer(cells: list[str], args: argparse.Namespace) -> list[str]:
    """``cells`` and, unless --no-torchrun, torchrun's cell of each of their faults."""
    if args.no_torchrun:
        return [c for c in cells if not c.endswith(PEER)]
    faults = dict.fromkeys(c.split("/")[0] for c in cells)
    return cells + [f"{f}/{PEER}" for f in faults if f"{f}/{PEER}" not in cells]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="", help="comma-separated FAULT/STRATEGY/BACKEND globs")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--all", action="store_true", help="every cell of the matrix")
    p.add_argument("--keep", action="store_true", help="keep the runs' directories")
    p.add_argument(
        "--no-torchrun", action="store_true", help="no torchrun cell beside the stalwart cells"
    )
    p.add_argument(
        "--torchrun-cap",
        type=float,
        default=120.0,
        help="seconds after the fault a torchrun job still running is stopped (default 120)",
    )
    args = p.parse_args()
    why = lab_missing()
    if why is None and any(c.endswith("/etcd") for c in select(args)) and not shutil.which("etcd"):
        why = "the etcd cells need the etcd binary on PATH"
    if why:
        raise SystemExit(f"bench/partition.py: {why}")
    cells = select(args)
    root = Path(tempfile.mkdtemp(prefix="stalwart-partbench-"))
    refs: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    try:
        for strategy in sorted({c.split("/")[1] for c in cells} - {"torchrun"}):
            refs[strategy] = reference(strategy, root / f"ref-{strategy}")
        for name in cells:
            t0 = time.monotonic()
            try:
                ref = refs.get(name.split("/")[1], {})
                results[name] = run_cell(name, ref, root, args.torchrun_cap)
            except Exception as err:  # one cell's failure is its outcome
                results[name] = {"outcome": f"error: {type(err).__name__}: {str(err)[:300]}"}
            results[name]["wall_s"] = round(time.monotonic() - t0, 1)
            print(f"  {name}: {results[name]}", file=sys.stderr, flush=True)
    finally:
        if args.keep or any(r["outcome"] != "ok" for r in results.values()):
            print(f"runs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    report(results)


def report(results: dict[str, dict[str, Any]]) -> None:
    cols = ["detect_s", "recover_s", "gap_s", "step_ms", "redone", "split_brain", "refused", "rc1"]
    print(f"{'cell':<24} " + " ".join(f"{c:>11}" for c in cols) + "  outcome")
    for name, r in results.items():
        print(f"{name:<24} " + " ".join(f"{r.get(c)!s:>11}" for c in cols) + f"  {r['outcome']}")
    out = {
        "partition_cells": results,
        "partition_cells_run": len(results),
        "partition_cells_ok": sum(r["outcome"] == "ok" for r in results.values()),
        "partition_split_brain_steps": sum(r.get("split_brain") or 0 for r in results.values()),
        "partition_refused_commits": sum(r.get("refused") or 0 for r in results.values()),
        "partition_vs_torchrun": versus(results),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


def versus(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each stalwart cell beside torchrun's cell of the same fault: both detection times,
    both longest step gaps and their ratio (stalwart's over torchrun's; torchrun's is a
    lower bound when it was stopped at the cap), and both outcomes."""
    out = {}
    for name, r in results.items():
        fault, strategy, _ = name.split("/")
        peer = results.get(f"{fault}/{PEER}")
        if strategy == "torchrun" or peer is None:
            continue
        gap, peer_gap = r.get("gap_s"), peer.get("gap_s")
        out[name] = {
            "detect_s": r.get("detect_s"),
            "torchrun_detect_s": peer.get("detect_s"),
            "gap_s": gap,
            "torchrun_gap_s": peer_gap,
            "gap_ratio": round(gap / peer_gap, 3) if gap and peer_gap else None,
            "torchrun_capped": peer.get("capped"),
            "outcome": r["outcome"],
            "torchrun_outcome": peer["outcome"],
        }
    return out


if __name__ == "__main__":
    main()
