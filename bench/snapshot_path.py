"""Snapshot-path benchmark: what snapshots, persists and commits cost the step loop.

Runs bench/_snapshot_job.py (the demo's DDP transformer, 2 workers, ``--strategy
flash``) under `stalwart run` with ``--persist-every`` N, ``--reps`` times, and reads
each rank's per-step loop time (one ``sess.steps`` yield to the next) and the event log.

Figures (medians over ranks and repetitions):
- ``cadence_step_s``: the loop time of step 6, where the snapshot cadence is chosen
  (rank 0 publishes it; the others pick it up), vs ``steady_step_s``, the median of the
  steps after it that neither persist nor are step 6;
- ``persist_step_s``: the median loop time of the steps that hand a persist over;
- ``snapshots_logged`` / ``last_snapshot_logged``: the snapshot events in the log, and
  whether the final step's one is among them (every run ends with a snapshot of it).
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = HERE / "_snapshot_job.py"
CADENCE_STEP = 6


def run_once(work: Path, steps: int, persist_every: int, timeout: float) -> dict[str, Any]:
    run_dir, log = work / "run", work / "steps.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "stalwart.cli.main",
        "run",
        "--rdzv-id",
        f"bench-{uuid.uuid4().hex[:8]}",
        "--run-dir",
        str(run_dir),
        "--nproc-per-node",
        "2",
        "--strategy",
        "flash",
        "--persist-every",
        str(persist_every),
        str(JOB),
        "--steps",
        str(steps),
        "--step-log",
        str(log),
    ]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"stalwart run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    events = [
        json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line
    ]
    snaps = sorted({int(e["step"]) for e in events if e["kind"] == "snapshot"})
    persisted = {int(e["step"]) for e in events if e["kind"] == "persist_begin"}
    cadence = [r["loop_s"] for r in rows if r["step"] == CADENCE_STEP]
    steady = [
        r["loop_s"]
        for r in rows
        if r["step"] > CADENCE_STEP + 1 and r["step"] not in persisted and r["step"] % 2 == 1
    ]
    persist = [r["loop_s"] for r in rows if r["step"] in persisted and r["step"] > 2]
    around = {
        str(s): max(r["loop_s"] for r in rows if r["step"] == s)
        for s in range(CADENCE_STEP - 2, CADENCE_STEP + 3)
    }
    return {
        "around_cadence_s": around,  # steps 4..8, the slower rank's
        "cadence_step_s": max(cadence),  # the slower rank's: the one that waited
        "steady_step_s": statistics.median(steady),
        "persist_step_s": statistics.median(persist) if persist else 0.0,
        "snapshots_logged": len(snaps),
        "last_snapshot_logged": steps in snaps,
        "persists_ok": sum(1 for e in events if e["kind"] == "persist_end" and e["ok"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--persist-every", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    runs = []
    for _ in range(args.reps):
        work = Path(tempfile.mkdtemp(prefix="snap-bench-"))
        try:
            runs.append(run_once(work, args.steps, args.persist_every, args.timeout))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {
        k: statistics.median(float(r[k]) for r in runs)
        for k in ("cadence_step_s", "steady_step_s", "persist_step_s")
    }
    result["snapshots_logged"] = min(int(r["snapshots_logged"]) for r in runs)
    result["last_snapshot_logged"] = all(r["last_snapshot_logged"] for r in runs)
    result["persists_ok"] = min(int(r["persists_ok"]) for r in runs)
    result["runs"] = runs
    for key in ("cadence_step_s", "steady_step_s", "persist_step_s"):
        print(f"{key:<24}{result[key] * 1e3:9.2f} ms")
    print(f"{'snapshots_logged':<24}{result['snapshots_logged']:9d}")
    print(f"{'last_snapshot_logged':<24}{result['last_snapshot_logged']!s:>9}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
