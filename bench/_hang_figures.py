"""bench/recovery.py's hang and verdict figures (the job: bench/_hang_job.py).

- ``false_hang_kills``: hang kills in fault-free jobs whose rank 0 runs a CPU-busy eval
  (``--eval-s``, default 3 s, 100x+ the step time) every 10 steps, not declared with
  ``sess.pause``, as a stalwart script and as a plain script. Must be 0.
- ``hang_detect_goal_s``: max(3 x p99 step, 2 s) of the SIGSTOP runs, the goal that
  ``hang_detect_s`` (measured by recovery.py) must meet.
- ``crash_loop_verdict_s``: a deterministic bug (rank 1 raises at step 10 in every
  incarnation): from the first failure to the job's exit with the verdict, per strategy.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = HERE / "_hang_job.py"


def _events(work: Path) -> list[dict[str, Any]]:
    path = work / "run" / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cmd(work: Path, strategy: str, job_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "stalwart.cli.main",
        "run",
        "--nproc-per-node",
        "2",
        "--rdzv-id",
        f"bench-{uuid.uuid4().hex[:6]}",
        "--run-dir",
        str(work / "run"),
        "--strategy",
        strategy,
        "--redirect",
        str(JOB),
        *job_args,
    ]


Runner = Callable[[list[str], Path, float, dict[str, str]], int]


def false_hang_kills(root: Path, run: Runner, env: dict[str, str], eval_s: float) -> dict[str, Any]:
    kills, rcs = 0, {}
    for mode in ("stalwart", "plain"):
        work = root / f"false-hang-{mode}"
        work.mkdir()
        args = ["--mode", mode, "--steps", "30", "--eval-every", "10", "--eval-s", str(eval_s)]
        rcs[mode] = run(_cmd(work, "flash", args), work, 300.0, env)
        kills += sum(
            1 for e in _events(work) if e["kind"] == "fault_detected" and e["fault"] == "hang"
        )
    return {"false_hang_kills": kills, "false_hang_rc": rcs, "false_hang_eval_s": eval_s}


def crash_loop_verdicts(root: Path, run: Runner, env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("flash", "restart", "elastic"):
        work = root / f"crash-loop-{strategy}"
        work.mkdir()
        rc = run(_cmd(work, strategy, ["--steps", "30", "--bug-at", "10"]), work, 300.0, env)
        events = _events(work)
        first = next((e["t"] for e in events if e["kind"] == "fault_detected"), None)
        end = next((e for e in events if e["kind"] == "run_end"), None)
        if first is not None and end is not None:
            out[f"crash_loop_verdict_s_{strategy}"] = float(end["t"]) - float(first)
        out[f"crash_loop_rc_{strategy}"] = rc
        out[f"crash_loop_reason_{strategy}"] = str(end["reason"]) if end else None
    times = [v for k, v in out.items() if k.startswith("crash_loop_verdict_s_")]
    out["crash_loop_verdict_s"] = max(times) if times else None
    return out


def p99_step_s(log_path: Path, before_step: int = 50) -> float | None:
    """p99 of the rank-0 step durations before ``before_step`` (from its step log)."""
    if not log_path.exists():
        return None
    recs = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
    steps = sorted((int(r["step"]), float(r["t"])) for r in recs if "step" in r)
    steps = [s for s in steps if 5 < s[0] < before_step]
    durs = sorted(b[1] - a[1] for a, b in itertools.pairwise(steps) if b[0] == a[0] + 1)
    if not durs:
        return None
    return durs[min(len(durs) - 1, math.ceil(0.99 * len(durs)) - 1)]
