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
Every run of the plan runs once per repetition (``--reps``, default 3; bench/_harness.py),
in an order reversed on every other repetition, and each figure is the median over the
repetitions with its spread (the ratios, memory vs disk and on vs off, taken within a
repetition); a repetition whose job failed or whose node was never killed makes the line
``valid: false``.
  etcd-bounce             etcd SIGKILLed and restarted on its data dir mid-run

Snapshots every `--snapshot-every` steps, longer than one replication round (size / rate):
survivors keep their two newest snapshots, so the replica must be one of them.

Definitions (rank 0's step log, wall clock): RTO = fault -> end of the first step
completed in the generation after it (detection included: the killed agent's watched
connection ends at once, agent/cluster/_peerwatch.py; a silent machine waits for its lease);
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

from _harness import Invalid, add_arguments, fault_shortfall, interleaved, repeat
from _two_nodes import TwoNodes, free_port, read_jsonl
from _two_nodes import events as job_events

HERE = Path(__file__).resolve().parent
JOB = HERE.parent / "examples" / "train_sharded.py"
NAN = float("nan")


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


def _plan(args: argparse.Namespace) -> list[tuple[str, list[str], bool]]:
    kill = ["--chaos", f"kill node=1 at=step:{args.kill_step}"]
    rep = ["--replica-rate", str(args.replica_rate)]
    standby = ["--standby"]
    return [
        ("steady-off", [], False),
        ("steady-on", rep, False),
        ("steady-standby", [*rep, *standby], False),
        ("loss-memory", [*rep, *standby, *kill], False),
        ("loss-disk", ["--persist-every", str(args.persist_every), *standby, *kill], False),
        ("loss-mem-cold", [*rep, *kill], False),
        ("etcd-bounce", [], True),
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
    add_arguments(p)  # --reps: every run of the plan once per repetition, order interleaved
    return p


def _get(run: dict[str, Any] | None, key: str) -> float:
    return float(run.get(key, NAN)) if run is not None else NAN


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else NAN


def repetition_figures(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One repetition's figures (NaN: a run skipped or a figure not measured)."""
    mem, disk, cold = runs.get("loss-memory"), runs.get("loss-disk"), runs.get("loss-mem-cold")
    off = _get(runs.get("steady-off"), "step_s")
    return {
        "node_loss_rto_memory_s": _get(mem, "rto_s"),
        "node_loss_rto_disk_s": _get(disk, "rto_s"),
        # the issue-7 figure, per pair: peer memory's RTO over the disk path's
        "node_loss_rto_memory_vs_disk": _ratio(_get(mem, "rto_s"), _get(disk, "rto_s")),
        "node_loss_restore_memory_s": _get(mem, "restore_s"),
        "node_loss_restore_disk_s": _get(disk, "restore_s"),
        "node_loss_progress_memory_s": _get(mem, "progress_s"),
        "node_loss_progress_disk_s": _get(disk, "progress_s"),
        "node_loss_detect_s": _get(mem, "detect_s"),
        "node_loss_rto_memory_no_standby_s": _get(cold, "rto_s"),
        "standbys_used": [None if r is None else r.get("standbys_used") for r in (mem, disk)],
        # lost ranks whose standby already held the agreed replica (no copy at restore)
        "replica_restores_preloaded": None if mem is None else mem.get("preloaded"),
        # RTO less the detection of the loss (the same for both variants)
        "node_loss_rto_after_detect_memory_s": _get(mem, "rto_s") - _get(mem, "detect_s"),
        "node_loss_rto_after_detect_disk_s": _get(disk, "rto_s") - _get(disk, "detect_s"),
        "memory_restore_tiers": [] if mem is None else mem.get("tiers", []),
        "disk_restore_tiers": [] if disk is None else disk.get("tiers", []),
        "replication_overhead_ratio": _ratio(_get(runs.get("steady-on"), "step_s"), off),
        "standby_overhead_ratio": _ratio(_get(runs.get("steady-standby"), "step_s"), off),
        "etcd_failover_pause_s": _get(runs.get("etcd-bounce"), "pause_s"),
    }


def check_run(name: str, run: dict[str, Any]) -> list[Invalid]:
    """A job that failed, or a loss run whose node was never killed, vouches for nothing."""
    out = []
    if any(c not in (0, 137) for c in run["codes"]):
        out.append(Invalid("", f"{name}: an agent exited {run['codes']} (0 or 137 expected)"))
    if name.startswith("loss"):
        short = fault_shortfall(name, 1 if "rto_s" in run else 0, 1)
        out += [Invalid("", short.reason)] if short else []
    return out


def _table(runs: dict[str, dict[str, Any]]) -> None:
    head = ["run", "codes", "step ms", "RTO s", "restore s", "progress s", "tiers"]
    print(f"{head[0]:<12} {head[1]:<10} " + " ".join(f"{h:>10}" for h in head[2:6]) + "  tiers")
    for name, r in runs.items():
        cells = [r["step_s"] * 1000, r.get("rto_s", NAN), r.get("restore_s", NAN)]
        cells.append(r.get("progress_s", NAN))
        line = f"{name:<12} {r['codes']!s:<10} " + " ".join(f"{c:>10.3f}" for c in cells)
        print(f"{line}  {','.join(r.get('tiers', []))}", flush=True)


def main() -> None:
    args = _parser().parse_args()
    if shutil.which("etcd") is None:
        sys.exit("bench/node_loss.py needs the etcd server binary on PATH (etcd-server)")
    plan = _plan(args)
    only = {x for x in args.only.split(",") if x}
    unknown = only - {name for name, _, _ in plan}
    if unknown:
        sys.exit(f"--only: unknown run(s) {sorted(unknown)}")
    plan = [x for x in plan if not only or x[0] in only]
    root = Path(tempfile.mkdtemp(prefix="stalwart-node-loss-"))
    etcd = Etcd(root)
    etcd.start()
    kept = args.keep

    def measure(rep: int) -> dict[str, Any]:
        nonlocal kept
        runs: dict[str, dict[str, Any]] = {}
        invalid: list[Invalid] = []
        for name, extra, bounce in interleaved(plan, rep):  # steady on/off, memory/disk pairs
            runs[name] = run_job(etcd, root, f"{name}.r{rep}", args, extra, bounce)
            print(f"  {name}.r{rep}: {runs[name]}", file=sys.stderr, flush=True)
            invalid += check_run(name, runs[name])
        kept = kept or bool(invalid)
        _table(runs)
        return repetition_figures(runs) | {"_invalid": invalid}

    try:
        summary = repeat(measure, args.reps)
    finally:
        etcd.stop()
        if kept:  # keep the agents' stderr
            print(f"logs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    extra = {
        "node_loss_rto_memory_all_s": summary.values("node_loss_rto_memory_s"),
        "node_loss_rto_disk_all_s": summary.values("node_loss_rto_disk_s"),
        "size_mb_per_node": args.size_mb,
        "replica_rate_mb_s": args.replica_rate,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary.document(extra)))


if __name__ == "__main__":
    main()
