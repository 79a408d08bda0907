"""HSDP 2x2 across 2 nodes: node-loss RTO restoring from the other replica group's memory
vs from disk (issue 15's ``node_loss_rto_memory_s`` vs ``node_loss_rto_disk_s``).

examples/train_hsdp.py on 2 agents x 2 workers (``--rdzv etcd://``, a private etcd), a
("replicate", "shard") mesh of 2 x 2: node 0 is replica group 0 (ranks 0, 1), node 1
group 1 (ranks 2, 3). Node 1 is killed at ``--kill-step`` (agent and workers at once).

  memory  node 0 adopts ranks 2 and 3; they read their shards from ranks 0 and 1's
          snapshot slots (the ``peer`` tier): no disk, no replication traffic
  disk    the same job with mesh dim 0 named otherwise (``--dim0-name rep``): FSDP2 runs
          the same HSDP, but stalwart does not know the replicas, so the lost ranks
          restore from the checkpoint persisted every ``--persist-every`` steps (their
          files dropped from the page cache at the fault: the lost machine's memory is
          gone), the survivors from their own snapshot of that step

RTO = fault -> the end of the first step of the generation after it (rank 0's step log),
detection included. ``measure()`` returns the figures (bench/fsdp.py merges them into its
JSON line); run alone it prints one JSON line. Both runs also report their restore
tiers, so a figure is never taken from the wrong path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _two_nodes import TwoNodes, read_jsonl
from _two_nodes import events as job_events
from node_loss import Etcd, _evict_lost_node

JOB = Path(__file__).resolve().parent.parent / "examples" / "train_hsdp.py"

__all__ = ["measure"]


def _run(
    etcd: Etcd, root: Path, name: str, args: argparse.Namespace, flags: list[str], own: list[str]
) -> dict[str, Any]:
    """One 2-node run with ``flags`` for `stalwart run` and ``own`` for the script."""
    job = f"hsdp-{name}-{uuid.uuid4().hex[:6]}"
    run_dir, log = root / name, root / f"{name}.steps"
    url = f"etcd://127.0.0.1:{etcd.client}/{job}"
    launch = ["--nproc-per-node", "2", "--node-lease", "5", "--hang-floor", "30"]
    launch += ["--chaos", f"kill node=1 at=step:{args.kill_step}"]
    script = [str(JOB), "--steps", str(args.steps), "--dim", str(args.dim)]
    script += ["--layers", str(args.layers), "--step-ms", str(args.step_ms)]
    script += ["--step-log", str(log)]
    nodes = TwoNodes(job, run_dir, root, name, ["--rdzv", url], [*launch, *flags], [*script, *own])
    stop = threading.Event()
    evictor = threading.Thread(target=_evict_lost_node, args=(run_dir, stop), daemon=True)
    nodes.start_all()
    evictor.start()
    try:
        nodes.wait(timeout=args.timeout)
    finally:
        stop.set()
        evictor.join()
        nodes.stop()
    steps, events = read_jsonl(log), job_events(run_dir)
    out: dict[str, Any] = {"codes": nodes.codes}
    faults = [e for e in events if e["kind"] == "fault_injected"]
    if not faults:
        return out
    t_fault = float(faults[0]["t"])
    before = [s for s in steps if s["t"] <= t_fault]
    gen0 = before[-1]["gen"] if before else 0
    after = [s for s in steps if s["t"] > t_fault and s["gen"] > gen0]
    out["rto_s"] = after[0]["t"] - t_fault if after else None
    restores = [e for e in events if e["kind"] == "restore" and e["t"] > t_fault]
    out["restore_s"] = max((float(e["seconds"]) for e in restores), default=None)
    out["tiers"] = {str(e["rank"]): str(e["tier"]) for e in restores}
    return out


def measure(
    steps: int = 120,
    kill_step: int = 60,
    dim: int = 1024,
    layers: int = 4,
    step_ms: float = 20.0,
    persist_every: int = 10,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Both runs, one each; the figures as a dict (None where a run did not recover)."""
    args = argparse.Namespace(
        steps=steps, kill_step=kill_step, dim=dim, layers=layers, step_ms=step_ms, timeout=timeout
    )
    root = Path(tempfile.mkdtemp(prefix="stalwart-hsdp-nl-"))
    etcd = Etcd(root)
    etcd.start()
    try:
        mem = _run(etcd, root, "memory", args, [], [])
        persist = ["--persist-every", str(persist_every)]
        disk = _run(etcd, root, "disk", args, persist, ["--dim0-name", "rep"])
    finally:
        etcd.stop()
        shutil.rmtree(root, ignore_errors=True)
    rto_m, rto_d = mem.get("rto_s"), disk.get("rto_s")
    state_mb = 3 * 4 * layers * (dim * dim + dim) / 2**20  # params + 2 Adam moments, fp32
    return {
        "node_loss_rto_memory_s": rto_m,
        "node_loss_rto_disk_s": rto_d,
        "node_loss_rto_memory_vs_disk": rto_m / rto_d if rto_m and rto_d else None,
        "node_loss_restore_memory_s": mem.get("restore_s"),
        "node_loss_restore_disk_s": disk.get("restore_s"),
        "node_loss_tiers_memory": mem.get("tiers"),
        "node_loss_tiers_disk": disk.get("tiers"),
        "node_loss_state_mb_per_replica": round(state_mb, 1),
        "node_loss_codes": [mem.get("codes"), disk.get("codes")],
        "load_avg_1m": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-step", type=int, default=60)
    p.add_argument("--dim", type=int, default=1024, help="each of --layers Linear(dim, dim)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--persist-every", type=int, default=10, help="steps (disk run)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    a = p.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("bench/_hsdp_node_loss.py needs the etcd server binary on PATH (etcd-server)")
    figures = measure(a.steps, a.kill_step, a.dim, a.layers, a.step_ms, a.persist_every, a.timeout)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
