"""Silent data corruption and NaN rollback (bench/detection.py part ``sdc``).

- ``sdc_overhead_ratio``: wall time per step of examples/train_lm.py under `stalwart run`
  (2 workers) with the digest check at ``--sdc-k`` (100) over the same run with
  ``--sdc-every 0``, measured from the event log (steps after calibration). The two
  runs of a pair run *at the same time*, so both see the same load on a shared machine
  (run one after the other, pairs measured 0.82-1.77 at load 15-25: the load moved
  between them); the median of the pairs' ratios is taken. ``sdc_cpu_ratio``: the same
  for the workers' CPU seconds per step (user + system, from the launcher's children),
  which a neighbour's load moves far less; ``sdc_digest_s``: one digest of the job's
  replicated state in-process, and ``sdc_digest_share`` that over K steps' time (the
  part of the ratio that is not noise);
- ``sdc_detect_steps``: steps from a ``corrupt`` fault to its ``sdc_detected`` event at
  that K (the bound is K + 1);
- ``nan_rollback_s``: from the end of the step whose loss was NaN to the first redone
  step's start (restore + agreement + re-entry), under ``--on-nan rollback``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_lm.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sdc-steps", type=int, default=400, help="steps per sdc run")
    p.add_argument("--sdc-dim", type=int, default=128, help="train_lm.py --dim")
    p.add_argument("--sdc-pairs", type=int, default=2, help="off/on pairs for the ratio")
    p.add_argument(
        "--sdc-k", type=int, default=100, help="--sdc-every of the on runs (the candidate default)"
    )


def _cmd(work: Path, name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    run_dir = work / name
    return [
        sys.executable,
        "-m",
        "stalwart.cli.main",
        "run",
        "--nproc-per-node",
        "2",
        "--rdzv-id",
        f"bench-sdc-{uuid.uuid4().hex[:6]}",
        "--run-dir",
        str(run_dir),
        *extra,
        str(EXAMPLE),
        "--steps",
        str(args.sdc_steps),
        "--dim",
        str(args.sdc_dim),
        "--layers",
        "2",
        "--seq",
        "32",
        "--batch",
        "8",
    ]


def _events(work: Path, name: str) -> list[Any]:
    from stalwart.metrics.events import read_events

    return list(read_events(str(work / name / "events.jsonl")).events)


def _run(work: Path, name: str, args: argparse.Namespace, extra: list[str]) -> list[Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = _cmd(work, name, args, extra)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: stalwart run failed: {done.stderr[-2000:]}")
    return _events(work, name)


def _pair(work: Path, i: int, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """The off and on runs of pair ``i`` at the same time: (off, on) wall s/step, then
    (off, on) CPU s/step (each launcher's rusage: its workers and persisters included,
    once they are reaped)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    runs = {"off": ["--sdc-every", "0"], "on": ["--sdc-every", str(args.sdc_k)]}
    procs: dict[str, tuple[subprocess.Popen[bytes], Any]] = {}
    for name, extra in runs.items():
        log = open(work / f"{name}{i}.log", "wb")  # noqa: SIM115 - closed below
        cmd = _cmd(work, f"{name}{i}", args, extra)
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log)
    cpu: dict[str, float] = {}
    for name, (proc, log) in procs.items():  # both reaped before either is judged
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.close()
        cpu[name] = usage.ru_utime + usage.ru_stime
    for name, (proc, _) in procs.items():
        if proc.returncode != 0:
            tail = (work / f"{name}{i}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name}{i}: stalwart run failed: {tail}")
    walls = {n: _step_wall(_events(work, f"{n}{i}")) for n in runs}
    return walls["off"], walls["on"], cpu["off"] / args.sdc_steps, cpu["on"] / args.sdc_steps


def _step_wall(events: list[Any], after: int = 20) -> float:
    """Wall seconds per step between the end of step ``after`` and the last step."""
    batches = [e for e in events if e.kind == "steps" and e["last_step"] >= after]
    first, last = batches[0], batches[-1]
    return float((last.t - first.t) / max(1, last["last_step"] - first["last_step"]))


def _digest_s(dim: int) -> float:
    """One digest of train_lm.py's replicated state (parameters + AdamW moments)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_lm import TinyLM

    from stalwart.runtime.integrity._digest import state_digest

    model = TinyLM(128, dim, 2, 32)
    tensors = [p.detach() for p in model.parameters()] * 3  # + exp_avg, exp_avg_sq
    state_digest(tensors)
    t0 = time.perf_counter()
    for _ in range(20):
        state_digest(tensors)
    return (time.perf_counter() - t0) / 20


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    k = args.sdc_k
    ratios, cpu_ratios, walls = [], [], []
    for i in range(args.sdc_pairs):
        for attempt in range(3):  # a launcher that could not start its workers at this load
            try:
                off, on, cpu_off, cpu_on = _pair(work, i, args)
                break
            except RuntimeError as err:
                print(f"sdc: pair {i} attempt {attempt + 1} failed: {str(err)[-200:]}", flush=True)
                for name in ("off", "on"):
                    shutil.rmtree(work / f"{name}{i}", ignore_errors=True)
        else:
            raise RuntimeError(f"sdc: pair {i} failed 3 times")
        ratios.append(on / off)
        cpu_ratios.append(cpu_on / cpu_off)
        walls.append(off)
    at_corrupt, at_nan = args.sdc_steps // 3, 2 * args.sdc_steps // 3
    chaos = f"corrupt rank=1 at=step:{at_corrupt}; nan rank=0 at=step:{at_nan}"
    faults = ["--sdc-every", str(k), "--on-nan", "rollback", "--chaos", chaos]
    events = _run(work, "faults", args, faults)
    (sdc,) = [e for e in events if e.kind == "sdc_detected"]
    # with the replica checks on, the first NaN replays from the verified snapshot, the
    # second (the same batch) is skipped: both are rollbacks; the first one is timed
    nan = next(e for e in events if e.kind == "numeric_fault")
    restore = [e for e in events if e.kind == "restore" and e.t <= nan.t][-1]
    resumed = next(e for e in events if e.kind == "steps" and e["t_first_start"] >= nan.t)
    digest = _digest_s(args.sdc_dim)
    return {
        "sdc_overhead_ratio": round(statistics.median(ratios), 4),
        "sdc_overhead_ratios": [round(r, 4) for r in ratios],
        "sdc_cpu_ratio": round(statistics.median(cpu_ratios), 4),
        "sdc_cpu_ratios": [round(r, 4) for r in cpu_ratios],
        "sdc_every": k,
        "sdc_step_s": round(statistics.median(walls), 5),
        "sdc_digest_s": round(digest, 6),
        "sdc_digest_share": round(digest / (k * statistics.median(walls)), 5),
        "sdc_detect_steps": int(sdc["detected_step"]) - at_corrupt,
        "nan_rollback_s": round(restore["seconds"] + resumed["t_first_start"] - nan.t, 4),
        "nan_steps_redone": at_nan - 1 - int(nan["restored_step"]),
        "sdc_load_avg": round(os.getloadavg()[0], 1),
    }
