"""FSDP2 under --strategy elastic, 4 -> 3 -> 4 workers: shrink and grow times, the steps
redone, and the loss gap to a fixed 4-worker run; the peer is the same job's whole-job
restart (--strategy restart) after a kill at the same step, measured in the same run.

Three runs of examples/train_fsdp.py (constant global batch from the resumable loader,
``--persist-every``): fixed (no fault), elastic (``kill rank=3 permanent`` then
``join rank=3``), restart (``kill rank=3``). Times come from the run's events: a
fault's ``fault_injected`` to the first ``recovery_end`` after it (the new group's rank 0
restored and formed: the next step starts then).
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

from recovery import _env, _run

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_fsdp.py"


def _job(work: Path, flags: list[str], dim: int, steps: int, timeout: float) -> Path:
    """One run; returns its loss log."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "loss.jsonl"
    cmd = [sys.executable, "-m", "stalwart.cli.main", "run", "--nproc-per-node", "3:4"]
    cmd += ["--rdzv-id", f"bench-fsdpel-{uuid.uuid4().hex[:6]}", "--run-dir", str(work / "run")]
    cmd += [*flags, str(EXAMPLE), "--dim", str(dim), "--layers", "2", "--seq", "16"]
    cmd += ["--batch", "2", "--global-batch", "24", "--samples", "4096", "--steps", str(steps)]
    _run([*cmd, "--loss-log", str(log)], work, timeout, _env())
    return log


def _events(work: Path) -> list[tuple[str, float, dict[str, Any]]]:
    rows = [json.loads(line) for line in (work / "run" / "events.jsonl").read_text().splitlines()]
    return [(r["kind"], float(r["t"]), r) for r in rows]


def _recoveries(work: Path) -> list[tuple[str, float, int]]:
    """(fault, seconds from its injection to the next recovery_end, steps lost)."""
    out, pending = [], None
    for kind, t, r in _events(work):
        if kind == "fault_injected":
            pending = (str(r["fault"]), t)
        elif kind == "recovery_end" and pending is not None:
            out.append((pending[0], t - pending[1], int(r["steps_lost"])))
            pending = None
    return out


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in rows}  # the last run of a step


def measure(
    root: Path, *, dim: int = 64, steps: int = 40, timeout: float = 300.0
) -> dict[str, Any]:
    persist = ["--persist-every", "4"]
    kill, join = max(2, steps // 4), max(3, steps // 2)
    fixed = _job(root / "fixed", ["--strategy", "elastic", *persist], dim, steps, timeout)
    chaos = f"kill rank=3 at=step:{kill} permanent; join rank=3 at=step:{join}"
    flags = ["--strategy", "elastic", *persist, "--chaos", chaos]
    elastic = _job(root / "elastic", flags, dim, steps, timeout)
    flags = ["--strategy", "restart", "--max-restarts", "2", *persist]
    _job(root / "restart", [*flags, "--chaos", f"kill rank=3 at=step:{kill}"], dim, steps, timeout)
    el, rs = _recoveries(root / "elastic"), _recoveries(root / "restart")
    want, got = _losses(fixed), _losses(elastic)
    gap = max((abs(got[s] - want[s]) / abs(want[s]) for s in want if s in got), default=None)
    shrink = el[0][1] if el else None
    restart = rs[0][1] if rs else None
    return {
        "elastic_shrink_s": shrink,
        "elastic_grow_s": el[1][1] if len(el) > 1 else None,
        "elastic_steps_redone": sum(n for _, _, n in el),
        "restart_rto_s": restart,
        "shrink_vs_restart_ratio": shrink / restart if shrink and restart else None,
        "elastic_loss_gap_max_rel": gap,
        "elastic_steps_complete": sorted(got) == list(range(1, steps + 1)),
    }
