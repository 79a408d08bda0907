"""bench/partition.py's torchrun arm: the same network fault between two lab hosts under
the launcher users would otherwise run. torchrun on each host with c10d rendezvous on
host 0 (``--rdzv-backend c10d --rdzv-endpoint h0:29500``), ``--max-restarts 3``, 2 workers
per host (a world of 4, as the stalwart cells), running the minimal job the usual way
(bench/_recovery_job.py ``--mode torchrun``: gloo DDP, torch.save every 20 steps, torch.load
on start). The same fault spec is injected once rank 0 logged the fault step.

Bounded: a job still running ``cap_s`` after the fault is stopped (torchrun leaves a
partition to gloo's collective timeout, 30 min by default) and reported as such (exit code
124); every process of it is killed by pid (each launcher's tree is read before it dies,
since torchrun starts its workers in sessions of their own).

Per cell, as for the stalwart cells (times from the injection, wall clock): ``detect_s``
the first sign that torchrun saw a fault (a restart of the workers, or a launcher exiting
non-zero), ``recover_s`` rank 0's first step after a restart, ``gap_s`` the longest gap
between rank 0's steps from the fault on (to the stop, for a job stopped at the cap: a
lower bound then), ``redone`` steps rank 0 ran again from the last torch.save.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from _recovery_base import JOB, VENV_BIN

from stalwart.chaos.proctree import descendants

__all__ = ["PORT", "TorchrunJob", "run_torchrun_cell"]

PORT = 29500  # the c10d rendezvous store on host 0
STEPS = 300
FAULT_AT = 40
NPROC = 2
STOPPED = 124


class TorchrunJob:
    """One torchrun per lab host; :meth:`stop` kills every process of the job."""

    def __init__(self, lab: Any, work: Path, hosts: list[int]) -> None:
        self.lab, self.work, self.hosts = lab, work, hosts
        self.procs: list[subprocess.Popen[str]] = []
        self.ended_at: dict[int, float] = {}  # node -> when its launcher exited
        self.log_path = work / "steps.jsonl"

    def argv(self) -> list[str]:
        return [
            str(VENV_BIN / "torchrun"),
            *("--nnodes", str(len(self.hosts)), "--nproc-per-node", str(NPROC)),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"h{self.hosts[0]}:{PORT}"),
            *("--rdzv-id", "partbench", "--max-restarts", "3"),
            str(JOB),
            *("--mode", "torchrun", "--steps", str(STEPS), "--step-log", str(self.log_path)),
            *("--ckpt", str(self.work / "ckpt.pt"), "--ckpt-every", "20"),
        ]

    def start(self) -> TorchrunJob:
        self.work.mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="eth0",  # the lab host's own interface (docs/launch.md)
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # as bench/recovery.py's torchrun arm
        )
        for node, host in enumerate(self.hosts):
            out = open(self.work / f"torchrun{node}.log", "w")  # noqa: SIM115 - closed below
            try:
                proc = self.lab.popen(
                    host, self.argv(), cwd=str(self.work), env=env,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            finally:
                out.close()
            self.procs.append(proc)
        return self

    def records(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        out = []
        for line in self.log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def steps(self) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r["t"])) for r in self.records() if "step" in r]

    def wait_step(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(s >= step for s, _ in self.steps()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"torchrun: rank 0 never logged step {step}: {self.tails()}")
            time.sleep(0.2)

    def wait(self, cap_s: float) -> list[int]:
        """Each launcher's exit code; those still running after ``cap_s`` are stopped
        (``STOPPED``)."""
        deadline = time.monotonic() + cap_s
        while time.monotonic() < deadline and len(self.ended_at) < len(self.procs):
            for node, p in enumerate(self.procs):
                if node not in self.ended_at and p.poll() is not None:
                    self.ended_at[node] = time.time()
            time.sleep(0.2)
        running = [p.poll() is None for p in self.procs]
        self.stop()
        return [
            STOPPED if r else int(p.returncode) for r, p in zip(running, self.procs, strict=True)
        ]

    def stop(self) -> None:
        """Kill every process of the job, the workers (own sessions) included."""
        trees = {p.pid: descendants(p.pid) for p in self.procs if p.poll() is None}
        for pid, tree in trees.items():
            for victim in [pid, *tree]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)

    def tails(self) -> list[str]:
        out = []
        for node in range(len(self.hosts)):
            path = self.work / f"torchrun{node}.log"
            out.append(path.read_text()[-1500:] if path.exists() else "")
        return out


def run_torchrun_cell(
    lab: Any, spec: str, delayed: bool, work: Path, cap_s: float
) -> dict[str, Any]:
    """One torchrun cell on a started lab; ``delayed``: a delay fault (a forwarder for new
    connections, so injected before the start and healed 30 s after the fault step)."""
    job = TorchrunJob(lab, work, [0, 1])
    heal = threading.Timer(30, lab.heal) if delayed else None
    try:
        if delayed:
            lab.inject(spec)
        job.start()
        job.wait_step(FAULT_AT, timeout=300)
        t_fault = time.time()
        if heal is not None:
            heal.start()
        else:
            lab.inject(spec)
        rcs = job.wait(cap_s)
        t_end = time.time()
    finally:
        if heal is not None:
            heal.cancel()
        job.stop()
    return measure(job, rcs, t_fault, t_end, cap_s) | {"spec": spec}


def measure(
    job: TorchrunJob, rcs: list[int], t_fault: float, t_end: float, cap_s: float
) -> dict[str, Any]:
    recs = job.records()
    steps = [(int(r["step"]), float(r["t"])) for r in recs if "step" in r]
    restarts = [
        float(r["start"]) for r in recs if r.get("restart", 0) > 0 and r["start"] >= t_fault
    ]
    failed = [
        job.ended_at[n] for n, rc in enumerate(rcs) if rc not in (0, STOPPED) and n in job.ended_at
    ]
    seen = restarts + failed
    before = [t for s, t in steps if 10 <= s <= FAULT_AT]
    step_s = (
        statistics.median(b - a for a, b in itertools.pairwise(before)) if len(before) > 2 else 0.0
    )
    after = [t for _, t in steps if t >= t_fault - 5 * step_s]
    if STOPPED in rcs:
        after.append(t_end)  # the wait up to the stop counts: a lower bound
    gaps = [b - a for a, b in itertools.pairwise(after)]
    resumed = [t for _, t in steps if restarts and t >= restarts[0]]
    why = []
    for node, rc in enumerate(rcs):
        if rc == STOPPED:
            why.append(f"node {node} still running {cap_s:.0f} s after the fault: stopped")
        elif rc != 0:
            why.append(f"node {node} rc {rc}")
    last = max((s for s, _ in steps), default=0)
    if last < STEPS:
        why.append(f"last step {last} of {STEPS}")
    return {
        "detect_s": round(min(seen) - t_fault, 2) if seen else None,
        "recover_s": round(resumed[0] - t_fault, 2) if resumed else None,
        "gap_s": round(max(gaps), 2) if gaps else None,
        "step_ms": round(step_s * 1000, 1),
        "redone": len(steps) - len({s for s, _ in steps}),
        "split_brain": None,  # no generations to be in: torchrun restarts every worker
        "refused": None,
        "rc0": rcs[0],
        "rc1": rcs[1],
        "restarts": len(restarts),
        "capped": STOPPED in rcs,
        "outcome": "ok" if not why else "; ".join(why),
    }
