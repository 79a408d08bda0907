"""Retention under `stalwart run`: a long run with --persist-every keeps at most
--keep-last committed steps (plus milestones), and a restore after GC verifies."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.checkpoint import committed_steps, verify_step
from stalwart.checkpoint.storage import LocalStorage

from ._launch import events_of, stalwart_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
ARGS = ["--steps", "60", "--dim", "16", "--layers", "1", "--seq", "8", "--batch", "2"]


def _ckpt_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / "ckpt"
    dirs = [root, *sorted(p for p in root.glob("rank*") if p.is_dir())]
    return [d for d in dirs if any(d.glob("step_*"))]


@pytest.mark.timeout(240)
def test_long_run_keeps_a_bounded_checkpoint_dir_and_restores_after_gc(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = stalwart_run(
        run_dir,
        [
            "--nproc-per-node", "2", "--strategy", "restart", "--max-restarts", "1",
            "--persist-every", "2", "--keep-last", "2", "--keep-every", "25",
            "--chaos", "kill rank=0 at=step:52",
            str(EXAMPLE), *ARGS,
        ],
        timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    dirs = _ckpt_dirs(run_dir)
    assert dirs
    for d in dirs:
        storage = LocalStorage(str(d))
        steps = committed_steps(storage)
        milestones = [s for s in steps if s % 25 == 0]
        assert len(steps) - len(milestones) <= 2, (d, steps)  # 30 persists, 2 kept
        assert steps[-1] >= 52 and set(milestones) <= {25, 50}
        assert len(list((d / "data").iterdir())) <= len(steps) + 2  # packs freed too
        assert all(verify_step(storage, s).ok for s in steps)
    ends = [f for k, f in events_of(run_dir) if k == "recovery_end"]
    assert len(ends) == 1 and ends[0]["ok"]  # restored after GC had run many times
    assert [f["status"] for k, f in events_of(run_dir) if k == "run_end"] == ["ok"]
