"""bench/recovery.py's shared pieces: how a job is run and how its recovery is measured
(also used by bench/fsdp.py, bench/_fsdp_elastic.py and bench/_real_scripts.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from stalwart.chaos.proctree import descendants

VENV_BIN = Path(sys.executable).parent
JOB = Path(__file__).resolve().parent / "_recovery_job.py"  # the minimal job


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> int:
    with open(cwd / "launcher.log", "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = descendants(proc.pid)  # before the launcher dies and they are reparented
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            return -9


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def run_torchrun(work: Path, steps: int, fault: str, timeout: float) -> tuple[int, Path]:
    log = work / "steps.jsonl"
    cmd = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "3",
        str(JOB),
        "--mode",
        "torchrun",
        "--steps",
        str(steps),
        "--step-log",
        str(log),
        "--ckpt",
        str(work / "ckpt.pt"),
        "--fault",
        fault,
    ]
    return _run(cmd, work, timeout, _env()), log


def _fault_time(work: Path, log: list[dict[str, Any]]) -> float | None:
    for rec in log:
        if "fault" in rec:
            return float(rec["fault"])
    events = work / "run" / "events.jsonl"
    if events.exists():
        for line in events.read_text().splitlines():
            e = json.loads(line)
            if e["kind"] == "fault_injected":
                return float(e["t"])
    return None


def recovery_figures(
    work: Path, log_path: Path, fault_step: int = 50, t_fault: float | None = None
) -> dict[str, float | None]:
    """RTO, progress and lost steps from the rank-0 step log. A record after the fault
    belongs to the recovered run once it is a rollback (a step not after the newest one
    seen) or reaches the fault step (which needs the failed rank); records before that
    are steps already in flight when the fault struck."""
    log = _read_log(log_path)
    if t_fault is None:  # given by a bench that struck the fault itself
        t_fault = _fault_time(work, log)
    steps = [(int(r["step"]), float(r["t"])) for r in log if "step" in r]
    if t_fault is None:
        return {}
    out: dict[str, float | None] = {"rto_s": None, "progress_s": None, "steps_lost": None}
    newest = 0
    for i, (s, t) in enumerate(steps):
        if t > t_fault and (s <= newest or s >= fault_step):
            out["rto_s"] = t - t_fault
            out["steps_lost"] = float(newest - (s - 1))
            beyond = [t2 for s2, t2 in steps[i:] if s2 > newest]
            out["progress_s"] = beyond[0] - t_fault if beyond else None
            break
        newest = max(newest, s)
    events = work / "run" / "events.jsonl"
    if events.exists():
        for line in events.read_text().splitlines():
            e = json.loads(line)
            if e["kind"] == "fault_detected":
                out["detect_s"] = float(e["latency_s"])
                break
    return out


def steady_step_s(log_path: Path, skip: int = 20) -> float | None:
    """Mean wall time per step (snapshot stalls included) after ``skip`` warm-up steps."""
    steps = [(int(r["step"]), float(r["t"])) for r in _read_log(log_path) if "step" in r]
    steps = [x for x in steps if x[0] > skip]
    if len(steps) < 2:
        return None
    return (steps[-1][1] - steps[0][1]) / (steps[-1][0] - steps[0][0])


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None
