"""--strategy async against synchronous DDP at the same step count: the loss gap.

One job (examples/train_async.py: a 2-layer MLP fitting a fixed teacher, each worker its
own data partition, the same samples at every step under both routes) runs as
(a) synchronous DDP over ``--workers`` workers (``--strategy flash``), (b) async DiLoCo
over as many replica groups of one worker (``--sync-every H``), (c) async LocalSGD, and
(d) async DiLoCo with group 1 killed mid-run (dropped, restarted, rejoined). Each run's
held-out loss (4,096 samples never trained on) after ``--steps`` steps is compared with
(a)'s: ``loss_gap`` = held-out loss / sync's held-out loss (1.0: no gap). One run each
(the figures are deterministic up to the fault's timing). Final line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_async.py"
STALWART = str(Path(sys.executable).with_name("stalwart"))


def _run(tmp: Path, name: str, launch: list[str], train: list[str]) -> dict[str, Any]:
    cmd = [STALWART, "run", "--rdzv-id", f"gap-{uuid.uuid4().hex[:8]}"]
    cmd += ["--run-dir", str(tmp / f"run-{name}"), *launch, str(EXAMPLE), *train]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: stalwart run failed:\n{proc.stderr[-2000:]}")
    parts = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{name}.*"))]
    losses = [p["held_out"] for p in parts]
    events = [json.loads(line) for line in (tmp / f"run-{name}" / "events.jsonl").open()]
    syncs = [e for e in events if e["kind"] == "replica_sync"]
    return {
        "drops": sum(e["kind"] == "replica_drop" for e in events),
        "rejoins": sum(e["kind"] == "replica_rejoin" for e in events),
        "rounds_short": sum(bool(e["dropped"]) for e in syncs),
        "held_out": sum(losses) / len(losses),
        "groups_agree": len({p["params"] for p in parts}) == 1,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sync-every", type=int, default=20)
    args = p.parse_args()
    nproc = ["--nproc-per-node", str(args.workers)]
    train = ["--steps", str(args.steps), "--step-sleep", "0.01"]
    async_ = [*nproc, "--strategy", "async", "--sync-every", str(args.sync_every)]
    kill = ["--chaos", f"kill rank=1 at=step:{args.steps // 2 + args.sync_every // 2}"]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        runs = {
            "sync_ddp": _run(tmp, "sync", nproc, [*train, "--out", str(tmp / "sync")]),
            "diloco": _run(tmp, "diloco", async_, [*train, "--out", str(tmp / "diloco")]),
            "localsgd": _run(
                tmp,
                "localsgd",
                [*async_, "--outer", "localsgd"],
                [*train, "--out", str(tmp / "localsgd")],
            ),
            "diloco_kill": _run(
                tmp, "kill", [*async_, *kill], [*train, "--out", str(tmp / "kill")]
            ),
        }
    ref = runs["sync_ddp"]["held_out"]
    for name, r in runs.items():
        r["loss_gap"] = r["held_out"] / ref
        print(
            f"{name:12s} held-out {r['held_out']:.6f}  gap x{r['loss_gap']:.3f}  {r['wall_s']:.0f}s"
        )
    load = os.getloadavg()[0]
    print(
        json.dumps({"steps": args.steps, "sync_every": args.sync_every, "load": load, "runs": runs})
    )


if __name__ == "__main__":
    main()
