"""Silent data corruption and NaN rollback (bench/detection.py part ``sdc``).

- ``sdc_overhead_ratio``: wall time per step of examples/train_lm.py under `stalwart run`
  (2 workers) with the digest check at the default K over the same run with
  ``--sdc-every 0``, measured from the event log (steps after calibration), runs
  alternated (off, on, off, on) and the median of the pairs' ratios taken (the machine
  is shared and noisy); ``sdc_digest_s``: one digest of the job's replicated state
  in-process, and ``sdc_digest_share`` that over K steps' time (the part of the ratio
  that is not noise);
- ``sdc_detect_steps``: steps from a ``corrupt`` fault to its ``sdc_detected`` event at
  the default K (the bound is K + 1);
- ``nan_rollback_s``: from the end of the step whose loss was NaN to the first redone
  step's start (restore + agreement + re-entry), under ``--on-nan rollback``.
"""

from __future__ import annotations

import argparse
import os
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


def _run(work: Path, name: str, args: argparse.Namespace, extra: list[str]) -> list[Any]:
    from stalwart.metrics.events import read_events

    run_dir = work / name
    cmd = [
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
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: stalwart run failed: {done.stderr[-2000:]}")
    return list(read_events(str(run_dir / "events.jsonl")).events)


def _step_wall(events: list[Any], after: int = 20) -> float:
    """Wall seconds per step between the end of step ``after`` and the last step."""
    batches = [e for e in events if e.kind == "steps" and e["last_step"] >= after]
    first, last = batches[0], batches[-1]
    return float((last.t - first.t) / max(1, last["last_step"] - first["last_step"]))


def _digest_s(dim: int) -> float:
    """One digest of train_lm.py's replicated state (parameters + AdamW moments)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_lm import TinyLM

    from stalwart.runtime._digest import state_digest

    model = TinyLM(128, dim, 2, 32)
    tensors = [p.detach() for p in model.parameters()] * 3  # + exp_avg, exp_avg_sq
    state_digest(tensors)
    t0 = time.perf_counter()
    for _ in range(20):
        state_digest(tensors)
    return (time.perf_counter() - t0) / 20


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from stalwart.runtime.env import DEFAULTS

    k = DEFAULTS.sdc_every
    ratios, walls = [], []
    for i in range(args.sdc_pairs):
        off = _step_wall(_run(work, f"off{i}", args, ["--sdc-every", "0"]))
        on = _step_wall(_run(work, f"on{i}", args, []))
        ratios.append(on / off)
        walls.append(off)
    at_corrupt, at_nan = args.sdc_steps // 3, 2 * args.sdc_steps // 3
    chaos = f"corrupt rank=1 at=step:{at_corrupt}; nan rank=0 at=step:{at_nan}"
    events = _run(work, "faults", args, ["--on-nan", "rollback", "--chaos", chaos])
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
        "sdc_every": k,
        "sdc_step_s": round(statistics.median(walls), 5),
        "sdc_digest_s": round(digest, 6),
        "sdc_digest_share": round(digest / (k * statistics.median(walls)), 5),
        "sdc_detect_steps": int(sdc["detected_step"]) - at_corrupt,
        "nan_rollback_s": round(restore["seconds"] + resumed["t_first_start"] - nan.t, 4),
        "nan_steps_redone": at_nan - 1 - int(nan["restored_step"]),
        "sdc_load_avg": round(os.getloadavg()[0], 1),
    }
