"""Node-loss benchmark (issue 7): peer memory replicas vs disk, replication overhead, and
the pause of an etcd restart.

2 agents x 2 workers on loopback under ``--rdzv etcd://`` (a private etcd started here),
running examples/train_sharded.py: every rank owns ``--size-mb / 2`` of state (so
``--size-mb`` per node), updated deterministically per step, one small allreduce per step.

Runs (each a fresh job):
  steady-off / steady-on  no fault, replicas off / on -> replication_overhead_ratio
                          (median step time on / off, first quarter of steps left out)
  steady-standby          no fault, replicas and --standby (the standbys preload each
                          replica) -> standby_overhead_ratio (step time / steady-off's)
  loss-memory             replicas on, node 1 killed (agent, workers; its /dev/shm slots
                          removed by the adopter, as if the machine were gone): node 0
                          adopts its ranks and restores them from its replica memory
  loss-disk               the same fault with replicas off and --persist-every: the lost
                          ranks restore from the persisted checkpoint (survivors from
                          their own snapshot of the agreed step when they hold it)
  loss-mem-cold           loss-memory without --standby: the lost ranks start as new
                          processes (both loss variants above run with --standby)
Each loss variant runs --repeat times (default 3); the run with the median RTO is
reported, every RTO alongside.
  etcd-bounce             etcd SIGKILLed and restarted on its data dir mid-run

Snapshots every `--snapshot-every` steps, longer than one replication round (size / rate):
survivors keep their two newest snapshots, so the replica must be one of them.

Definitions (rank 0's step log, wall clock): RTO = fault -> end of the first step
completed in the generation after it (detection included: the killed agent's watched
connection ends at once, agent/_peerwatch.py; a silent machine waits for its lease);
restore_s = the slowest rank's restore (the "restore" events); progress = fault -> end of the first
step beyond the last step completed before the fault. etcd_failover_pause_s = the
longest gap between steps around the outage minus the median step time. In the disk
variant the lost node's checkpoint files are dropped from the page cache at the fault (its
memory is gone with it), so they are read from the disk. etcd keeps its data on /dev/shm
here (its fsyncs on a shared disk are not what is measured). Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _two_nodes import TwoNodes, free_port, read_jsonl
from _two_nodes import events as job_events

HERE = Path(__file__).resolve().parent
JOB = HERE.parent / "examples" / "train_sharded.py"


class Etcd:
    """A private single-member etcd on loopback (the test fixture's flags)."""

    def __init__(self, root: Path) -> None:
        # on tmpfs: this bench measures node loss, not etcd's fsyncs on a shared disk
        self.data = Path(f"/dev/shm/stalwart-nlbench-etcd-{uuid.uuid4().hex[:8]}")
        self.client, self.peer = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        url, peer = f"http://127.0.0.1:{self.client}", f"http://127.0.0.1:{self.peer}"
        self.proc = subprocess.Popen(
            [
                shutil.which("etcd") or "etcd",
                "--name=bench",
                f"--data-dir={self.data}",
                f"--listen-client-urls={url}",
                f"--advertise-client-urls={url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=bench={peer}",
                "--heartbeat-interval=25",
                "--election-timeout=250",
                "--log-level=error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.client), 0.2),
            ):
                return
            time.sleep(0.02)
        raise RuntimeError("etcd did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
        shutil.rmtree(self.data, ignore_errors=True)


def _evict_lost_node(run_dir: Path, stop: threading.Event) -> None:
    """When node 1 is killed, drop its ranks' checkpoint files from the page cache: a lost
    machine's memory is gone, so whoever restores its part reads them from storage, not
    from RAM. (Per-file POSIX_FADV_DONTNEED: no root needed, nothing else is evicted.)"""
    while not stop.wait(0.01):
        if any(e["kind"] == "fault_injected" for e in job_events(run_dir)):
            break
    else:
        return
    for rank_dir in ("rank2", "rank3"):  # node 1's ranks (2 nodes x 2 workers)
        for path in (run_dir / "ckpt" / rank_dir).rglob("*"):
            if path.is_file():
                with contextlib.suppress(OSError):
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)


def run_job(
    etcd: Etcd, root: Path, name: str, args: argparse.Namespace, extra: list[str], bounce: bool
) -> dict[str, Any]:
    job = f"nl-{name}-{uuid.uuid4().hex[:6]}"
    run_dir = root / name
    log = root / f"{name}.steps"
    url = f"etcd://127.0.0.1:{etcd.client}/{job}"
    launch = ["--nproc-per-node", "2", "--node-lease", str(args.node_lease)]
    launch += ["--hang-floor", str(args.hang_floor), "--snapshot-every", str(args.snapshot_every)]
    script = [
        str(JOB),
        "--steps",
        str(args.steps),
        "--size-mb",
        str(args.size_mb / 2),
        "--window-mb",
        str(min(8.0, args.size_mb / 8)),
        "--step-ms",
        str(args.step_ms),
        "--step-log",
        str(log),
    ]
    nodes = TwoNodes(job, run_dir, root, name, ["--rdzv", url], [*launch, *extra], script)
    nodes.start_all()
    t_kill = t_back = None
    stop = threading.Event()
    evictor = threading.Thread(target=_evict_lost_node, args=(run_dir, stop), daemon=True)
    evictor.start()
    try:
        if bounce:
            deadline = time.monotonic() + 300
            while len(read_jsonl(log)) < args.steps // 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            t_kill = time.time()
            etcd.kill()
            etcd.start()
            t_back = time.time()
        nodes.wait(timeout=900)
    finally:
        stop.set()
        evictor.join()
        nodes.stop()
    steps, events = read_jsonl(log), job_events(run_dir)
    res: dict[str, Any] = {"codes": nodes.codes, "steps": len(steps)}
    times = [s["t"] for s in steps]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    res["step_s"] = statistics.median(gaps[len(gaps) // 4 :]) if len(gaps) > 8 else float("nan")
    faults = [e for e in events if e["kind"] == "fault_injected"]
    if faults:
        t_fault = float(faults[0]["t"])
        before = [s for s in steps if s["t"] <= t_fault]
        gen0 = before[-1]["gen"] if before else 0
        last = before[-1]["step"] if before else 0
        after = [s for s in steps if s["t"] > t_fault and s["gen"] > gen0]
        res["rto_s"] = after[0]["t"] - t_fault if after else float("nan")
        beyond = [s for s in after if s["step"] > last]
        res["progress_s"] = beyond[0]["t"] - t_fault if beyond else float("nan")
        restores = [e for e in events if e["kind"] == "restore" and e["t"] > t_fault]
        res["restore_s"] = max((float(e["seconds"]) for e in restores), default=float("nan"))
        res["tiers"] = sorted({str(e["tier"]) for e in restores})
        detected = [e for e in events if e["kind"] == "fault_detected"]
        res["detect_s"] = float(detected[0]["latency_s"]) if detected else float("nan")
        joins = [e for e in events if e["kind"] == "member_join" and e["t"] > t_fault]
        res["standbys_used"] = sum(1 for e in joins if e.get("standby"))
        res["preloaded"] = sum(1 for e in restores if e.get("preloaded"))
    if t_kill is not None and t_back is not None:
        window = [g for a, g in zip(times, gaps, strict=False) if t_kill - 1 <= a <= t_back + 10]
        res["etcd_down_s"] = t_back - t_kill
        res["pause_s"] = max(window, default=float("nan")) - res["step_s"]
    return res


def _median_run(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose RTO is the median of ``tries`` (its own figures, consistent with
    each other), with every try's RTO alongside."""
    if len(tries) == 1 or "rto_s" not in tries[0]:
        return tries[0]
    ranked = sorted(tries, key=lambda r: r.get("rto_s", float("inf")))
    out = dict(ranked[len(ranked) // 2])
    out["rto_all_s"] = [round(r.get("rto_s", float("nan")), 3) for r in tries]
    out["codes"] = sorted({c for r in tries for c in r["codes"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=512.0, help="state per node (MB)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--kill-step", type=int, default=140)
    p.add_argument("--replica-rate", type=float, default=400.0, help="MB/s per node")
    p.add_argument("--persist-every", type=int, default=25, help="steps (disk variant)")
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=25,
        help="steps between snapshots: longer than a replication round (size / rate)",
    )
    p.add_argument("--node-lease", type=float, default=5.0, help="seconds (detection)")
    p.add_argument("--hang-floor", type=float, default=10.0, help="seconds")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated runs to do (steady-off,steady-on,steady-standby,loss-memory,"
        "loss-disk,loss-mem-cold,etcd-bounce); figures that need a skipped run are null",
    )
    p.add_argument("--keep", action="store_true", help="keep the run dirs and logs")
    p.add_argument(
        "--repeat", type=int, default=3, help="runs of each node-loss variant (median RTO)"
    )
    args = p.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("bench/node_loss.py needs the etcd server binary on PATH (etcd-server)")
    kill = ["--chaos", f"kill node=1 at=step:{args.kill_step}"]
    rep = ["--replica-rate", str(args.replica_rate)]
    standby = ["--standby"]
    root = Path(tempfile.mkdtemp(prefix="stalwart-node-loss-"))
    etcd = Etcd(root)
    etcd.start()
    runs: dict[str, dict[str, Any]] = {}
    try:
        plan = [
            ("steady-off", [], False),
            ("steady-on", rep, False),
            ("steady-standby", [*rep, *standby], False),
            ("loss-memory", [*rep, *standby, *kill], False),
            ("loss-disk", ["--persist-every", str(args.persist_every), *standby, *kill], False),
            ("loss-mem-cold", [*rep, *kill], False),
            ("etcd-bounce", [], True),
        ]
        only = {x for x in args.only.split(",") if x}
        unknown = only - {name for name, _, _ in plan}
        if unknown:
            sys.exit(f"--only: unknown run(s) {sorted(unknown)}")
        for name, extra, bounce in plan:
            if only and name not in only:
                continue
            reps = args.repeat if name.startswith("loss") else 1
            tries = []
            for i in range(reps):  # interleaved runs would not help: one job at a time
                tag = name if i == 0 else f"{name}.{i}"
                tries.append(run_job(etcd, root, tag, args, extra, bounce))
                print(f"  {tag}: {tries[-1]}", file=sys.stderr, flush=True)
            runs[name] = _median_run(tries)
    finally:
        etcd.stop()
        failed = any(c not in (0, 137) for r in runs.values() for c in r["codes"])
        if failed or args.keep:  # keep the agents' stderr
            print(f"logs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    nan = float("nan")
    empty: dict[str, Any] = {"step_s": nan}
    mem, disk = runs.get("loss-memory", empty), runs.get("loss-disk", empty)
    on, off = runs.get("steady-on", empty), runs.get("steady-off", empty)
    load = os.getloadavg()
    out = {
        "node_loss_rto_memory_s": round(mem.get("rto_s", float("nan")), 3),
        "node_loss_rto_disk_s": round(disk.get("rto_s", float("nan")), 3),
        "node_loss_restore_memory_s": round(mem.get("restore_s", float("nan")), 3),
        "node_loss_restore_disk_s": round(disk.get("restore_s", float("nan")), 3),
        "node_loss_progress_memory_s": round(mem.get("progress_s", float("nan")), 3),
        "node_loss_progress_disk_s": round(disk.get("progress_s", float("nan")), 3),
        "node_loss_detect_s": round(mem.get("detect_s", float("nan")), 3),
        "node_loss_rto_memory_all_s": mem.get("rto_all_s", []),
        "node_loss_rto_disk_all_s": disk.get("rto_all_s", []),
        "node_loss_rto_memory_no_standby_s": round(
            runs.get("loss-mem-cold", empty).get("rto_s", nan), 3
        ),
        "standbys_used": [mem.get("standbys_used"), disk.get("standbys_used")],
        # lost ranks whose standby already held the agreed replica (no copy at restore)
        "replica_restores_preloaded": mem.get("preloaded"),
        # RTO less the detection of the loss (the same for both variants)
        "node_loss_rto_after_detect_memory_s": round(
            mem.get("rto_s", float("nan")) - mem.get("detect_s", float("nan")), 3
        ),
        "node_loss_rto_after_detect_disk_s": round(
            disk.get("rto_s", float("nan")) - disk.get("detect_s", float("nan")), 3
        ),
        "memory_restore_tiers": mem.get("tiers", []),
        "disk_restore_tiers": disk.get("tiers", []),
        "replication_overhead_ratio": round(on["step_s"] / off["step_s"], 4),
        "standby_overhead_ratio": round(
            runs.get("steady-standby", empty)["step_s"] / off["step_s"], 4
        ),
        "etcd_failover_pause_s": round(runs.get("etcd-bounce", empty).get("pause_s", nan), 3),
        "size_mb_per_node": args.size_mb,
        "replica_rate_mb_s": args.replica_rate,
        "loadavg_1m": round(load[0], 2),
    }
    head = ["run", "codes", "step ms", "RTO s", "restore s", "progress s", "tiers"]
    print(f"{head[0]:<12} {head[1]:<10} " + " ".join(f"{h:>10}" for h in head[2:6]) + "  tiers")
    for name, r in runs.items():
        cells = [r["step_s"] * 1000, r.get("rto_s", nan), r.get("restore_s", nan)]
        cells.append(r.get("progress_s", nan))
        line = f"{name:<12} {r['codes']!s:<10} " + " ".join(f"{c:>10.3f}" for c in cells)
        print(f"{line}  {','.join(r.get('tiers', []))}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
