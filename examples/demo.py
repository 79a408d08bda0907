"""`make demo`: 2 nodes x 2 workers, a kill, a hang and a node loss, recovered by flash.

`make demo-elastic` (``--elastic``): the same cluster under ``--strategy elastic`` with a
constant global batch (examples/train_elastic.py): a worker lost for good, node 1 lost
for good, then node 1 joining again: 4 -> 3 -> 1 -> 3 workers, no survivor restarted;
the loss curve is compared with a fixed 4-worker run (examples/demo_elastic.py).

Runs the job of examples/train_lm.py twice as two `stalwart run` agents on loopback
(one per node): once without faults (cached under runs/demo/ once computed) and once
with chaos. Prints one line per incident (detection latency, RTO, steps lost, where the
state came from), a bit-for-bit verdict on the final parameters, and the effective
training time ratio (ETTR), all computed from the run's event log.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_lm.py"


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    run_dir: Path,
    train_args: list[str],
    chaos: str | None,
    out: Path,
    *,
    example: Path = EXAMPLE,
    launch: tuple[str, ...] = (
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--strategy",
        "flash",
        "--standby",  # node 0 keeps node 1's ranks parked: the node loss starts nothing
    ),
) -> float:
    """Two agents (node 0 and node 1) on loopback; returns the wall time."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    job = f"demo-{uuid.uuid4().hex[:6]}"
    common = [
        sys.executable,
        "-m",
        "stalwart.cli.main",
        "run",
        *launch,
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-id",
        job,
        "--run-dir",
        str(run_dir),
        "--redirect",
        "--node-lease",
        "2",
        "--max-restarts",
        "3",
    ]
    if chaos:
        common += ["--chaos", chaos]
    t0 = time.time()
    procs = []
    for node in (0, 1):
        log = open(run_dir / f"agent{node}.log", "w")  # noqa: SIM115 - closed below
        cmd = [*common, "--node-rank", str(node), str(example), *train_args]
        if node == 0:
            cmd += ["--out", str(out)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [p.wait(timeout=900) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    if codes[0] != 0:
        sys.exit(f"demo: node 0 failed (rc {codes[0]}); see {run_dir}/agent0.log")
    return time.time() - t0


def digest(path: Path) -> tuple[str, dict[str, object]]:
    import torch

    state = torch.load(path, weights_only=True)
    h = hashlib.sha256()
    for t in state.values():
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest(), state


def report(run_dir: Path) -> float | None:
    from stalwart.metrics.events import read_events
    from stalwart.metrics.goodput import account

    events = read_events(str(run_dir / "events.jsonl")).events
    g = account(events)
    steps = [e for e in events if e.kind == "steps"]
    for n, inc in enumerate(g.incidents, 1):
        where = inc.domain.get("rank")
        target = f"rank {where}" if where is not None else f"node {inc.domain.get('node')}"
        det = inc.detection_latency_s
        # RTO to the END of the first step after recovery (the definition)
        end = None
        if inc.t_resume is not None:
            after = [e for e in steps if e.t >= inc.t_resume]
            if after:
                first = after[0]
                end = first["t_first_start"] + first["busy_s"] / first["count"]
        rto = None if end is None else end - inc.t_fault
        if not inc.interrupted:  # reported only (a straggler under --on-straggler report)
            print(
                f"  incident {n}: {inc.fault:<9} {target:<7} reported, training went on: {inc.how}"
            )
            continue
        print(
            f"  incident {n}: {inc.fault:<9} {target:<7} detected in "
            f"{det if det is not None else float('nan'):6.3f} s   RTO {rto or float('nan'):5.2f} s"
            f"   steps lost {inc.steps_lost_reported}   restored step {inc.restored_step} "
            f"from {inc.source_tier or '?'}"
        )
    ettr = g.ettr
    print(
        f"  ETTR {ettr:.3f}: {g.buckets['productive']:.1f} s productive of {g.wall_s:.1f} s "
        "wall (startup included)"
        if ettr is not None
        else "  ETTR: n/a"
    )
    return ettr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "demo"))
    p.add_argument("--fresh", action="store_true", help="recompute the fault-free run")
    p.add_argument("--elastic", action="store_true", help="the elastic demo (make demo-elastic)")
    args = p.parse_args()
    if args.elastic:
        from demo_elastic import main as elastic_main

        return elastic_main(args, run_job)
    s = args.steps
    chaos = (
        f"kill rank=1 at=step:{s // 4}; hang rank=2 at=step:{s // 2}; "
        f"kill node=1 at=step:{3 * s // 4}"
    )
    train = ["--steps", str(s)]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(EXAMPLE.read_bytes() + " ".join(train).encode()).hexdigest()[:12]
    ref = out / f"reference-{key}.pt"
    print(
        "stalwart demo: 2 nodes x 2 workers (4 ranks, gloo on CPU), a small transformer LM "
        "on synthetic data, --strategy flash"
    )
    if args.fresh or not ref.exists():
        print("[1/2] fault-free run ...", end=" ", flush=True)
        took = run_job(out / "reference", train, None, ref)
        print(f"{took:.1f} s")
    else:
        print(f"[1/2] fault-free run: cached ({_rel(ref)})")
    print(f"[2/2] run with chaos: {chaos}", flush=True)
    got = out / "chaos.pt"
    took = run_job(out / "chaos", train, chaos, got)
    print(f"  finished in {took:.1f} s; run dir {_rel(out / 'chaos')}")
    report(out / "chaos")
    (ref_hash, ref_state), (got_hash, got_state) = digest(ref), digest(got)
    import torch

    same = ref_state.keys() == got_state.keys() and all(
        torch.equal(ref_state[k], got_state[k]) for k in ref_state
    )
    verdict = "BIT-IDENTICAL" if same else "DIFFERENT"
    print(
        f"verdict: final parameters {verdict} to the fault-free run "
        f"(sha256 {got_hash[:16]} vs {ref_hash[:16]})"
    )
    print(
        f"details: stalwart report {_rel(out / 'chaos')}  "
        f"(events: {_rel(out / 'chaos' / 'events.jsonl')})"
    )
    return 0 if same else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
