"""FSDP2 under stalwart: steady-state overhead against plain FSDP2 under torchrun, and the
recovery of a kill -9 of one of 2 workers under flash. Prints a table and a final JSON line.

The same job (bench/_fsdp_job.py: examples/train_fsdp.py's model, dim 128, 2 blocks,
2 gloo workers) runs (a) under torchrun, plain FSDP2 over ``init_device_mesh``, no faults;
(b) under ``stalwart run`` with ``mesh=sess.mesh`` and the default snapshot policy, no
faults; (c) as (b) with rank 1 killed at step 50. Overhead = steady step time (b) / (a);
RTO and progress as in bench/recovery.py. Medians of ``--reps`` repetitions.

Then the checkpoint figures of a 4-rank FSDP2 state of ``--ckpt-mb`` (bench/_fsdp_ckpt.py,
one run): ``persist_s`` vs ``dcp_save_s`` of the same sharded state, and
``restore_reshard_s`` (4 -> 2 ranks) vs ``dcp_load_reshard_s``, with their ratios.
``--ckpt-only`` measures those alone.

Then FSDP2 under ``--strategy elastic`` (bench/_fsdp_elastic.py, one run): 4 -> 3 -> 4
workers, ``elastic_shrink_s``/``elastic_grow_s`` beside the same job's ``restart_rto_s``
and the loss gap to a fixed 4-worker run. ``--elastic-only`` measures those alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fsdp_ckpt import measure as measure_ckpt
from _fsdp_elastic import measure as measure_elastic
from _hsdp_node_loss import measure as measure_hsdp_node_loss
from recovery import VENV_BIN, _env, _median, _run, recovery_figures, steady_step_s

JOB = Path(__file__).resolve().parent / "_fsdp_job.py"


def _torchrun(work: Path, steps: int, timeout: float) -> Path:
    log = work / "steps.jsonl"
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(JOB)]
    cmd += ["--mode", "torchrun", "--steps", str(steps), "--step-log", str(log)]
    _run(cmd, work, timeout, _env())
    return log


def _stalwart(work: Path, steps: int, chaos: str, timeout: float) -> Path:
    log = work / "steps.jsonl"
    cmd = [sys.executable, "-m", "stalwart.cli.main", "run", "--nproc-per-node", "2"]
    cmd += ["--rdzv-id", f"bench-fsdp-{uuid.uuid4().hex[:6]}", "--run-dir", str(work / "run")]
    if chaos:
        cmd += ["--chaos", chaos]
    cmd += [str(JOB), "--mode", "stalwart", "--steps", str(steps), "--step-log", str(log)]
    _run(cmd, work, timeout, _env())
    return log


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--ckpt-mb", type=int, default=512, help="FSDP2 state saved and resharded")
    p.add_argument("--ckpt-only", action="store_true", help="only the checkpoint figures")
    p.add_argument("--elastic-only", action="store_true", help="only the elastic figures")
    args = p.parse_args()
    if args.elastic_only:
        with tempfile.TemporaryDirectory(prefix="bench-fsdp-el-") as tmp:
            result = measure_elastic(Path(tmp), timeout=args.timeout)
        print(json.dumps(result | {"load_average": os.getloadavg()[0]}))
        return 0
    if args.ckpt_only:
        with tempfile.TemporaryDirectory(prefix="bench-fsdp-ckpt-") as tmp:
            print(json.dumps(measure_ckpt(Path(tmp), args.ckpt_mb)))
        return 0
    plain: list[float | None] = []
    ours: list[float | None] = []
    rec: list[dict[str, float | None]] = []
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        root = Path(tmp)
        for rep in range(args.reps):
            dirs = [root / f"{name}-{rep}" for name in ("plain", "ours", "kill")]
            for d in dirs:
                d.mkdir()
            plain.append(steady_step_s(_torchrun(dirs[0], args.steps, args.timeout)))
            ours.append(steady_step_s(_stalwart(dirs[1], args.steps, "", args.timeout)))
            log = _stalwart(dirs[2], args.steps, "kill rank=1 at=step:50", args.timeout)
            rec.append(recovery_figures(dirs[2], log))
    p_med, o_med = _median(plain), _median(ours)
    result: dict[str, Any] = {
        "plain_fsdp_step_s": p_med,
        "stalwart_fsdp_step_s": o_med,
        "overhead_ratio": o_med / p_med if p_med and o_med else None,
        "overhead_ratio_all": [
            o / q if o and q else None for o, q in zip(ours, plain, strict=True)
        ],
        "flash_rto_s": _median([r.get("rto_s") for r in rec]),
        "flash_progress_s": _median([r.get("progress_s") for r in rec]),
        "crash_detect_s": _median([r.get("detect_s") for r in rec]),
        "steps_lost_flash": _median([r.get("steps_lost") for r in rec]),
        "reps": args.reps,
        "load_average": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-ckpt-") as tmp:
        result.update(measure_ckpt(Path(tmp), args.ckpt_mb))
    result.update(measure_hsdp_node_loss())  # HSDP 2x2 on 2 nodes: memory vs disk
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-el-") as tmp:
        result.update(measure_elastic(Path(tmp), timeout=args.timeout))
    rows = [
        ("plain FSDP2 step (torchrun)", p_med, "s"),
        ("FSDP2 step under stalwart", o_med, "s"),
        ("overhead ratio", result["overhead_ratio"], "x"),
        ("flash RTO (kill -9 of rank 1)", result["flash_rto_s"], "s"),
        ("flash progress", result["flash_progress_s"], "s"),
        ("crash detection", result["crash_detect_s"], "s"),
        ("steps redone", result["steps_lost_flash"], ""),
        ("persist (4 ranks)", result["persist_s"], "s"),
        ("dcp.save (4 ranks)", result["dcp_save_s"], "s"),
        ("restore resharded 4 -> 2", result["restore_reshard_s"], "s"),
        ("dcp.load resharded 4 -> 2", result["dcp_load_reshard_s"], "s"),
        ("HSDP node loss RTO, memory", result.get("node_loss_rto_memory_s"), "s"),
        ("HSDP node loss RTO, disk", result.get("node_loss_rto_disk_s"), "s"),
        ("elastic shrink 4 -> 3", result.get("elastic_shrink_s"), "s"),
        ("elastic grow 3 -> 4", result.get("elastic_grow_s"), "s"),
        ("restart RTO (same job)", result.get("restart_rto_s"), "s"),
    ]
    for name, value, unit in rows:
        shown = "-" if value is None else f"{value:.3f}{unit}"
        print(f"{name:32s} {shown}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
