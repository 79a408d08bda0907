"""``--strategy async`` end to end: 2 replica groups of one worker on loopback, group 1
killed between two synchronisations. The job finishes; group 0 decides the next round
without waiting for group 1 (``replica_sync`` with group 1 dropped), group 1 is started
again and rejoins at a sync boundary with the global state (``replica_rejoin``), takes
part in the rounds after it, and both groups end with the same parameters (the last
step is a sync boundary)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._launch import events_of, stalwart_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_async.py"


@pytest.mark.timeout(200)
def test_a_failed_group_is_dropped_then_rejoins(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = tmp_path / "final"
    args = ["--nproc-per-node", "2", "--strategy", "async", "--sync-every", "5"]
    args += ["--chaos", "kill rank=1 at=step:14"]
    args += [str(EXAMPLE), "--steps", "30", "--step-sleep", "0.05", "--out", str(out)]
    proc = stalwart_run(run_dir, args, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]

    events = events_of(run_dir)
    drops = [f for k, f in events if k == "replica_drop"]
    assert [(f["group"], f["cause"]) for f in drops] == [(1, "crash")]
    syncs = {f["round"]: f for k, f in events if k == "replica_sync"}
    assert sorted(syncs) == [1, 2, 3, 4, 5, 6]
    rejoin = next(f for k, f in events if k == "replica_rejoin")
    assert rejoin["group"] == 1 and rejoin["step"] == 5 * rejoin["round"]
    # the round after the kill (step 15) went on without group 1, unless group 1 was
    # back already (it rejoined with round 2's state and took part in round 3)
    dropped = [r for r, f in syncs.items() if f["dropped"] == [1]]
    assert dropped == list(range(3, rejoin["round"] + 1))
    assert all(syncs[r]["members"] == [0, 1] for r in syncs if r > rejoin["round"])
    assert any(k == "recovery_end" and f["source_tier"] == "transfer" for k, f in events)

    finals = [json.loads(Path(f"{out}.{part}").read_text()) for part in (0, 1)]
    assert finals[0]["params"] == finals[1]["params"]


@pytest.mark.timeout(400)
def test_a_relaunch_resumes_every_group_with_its_outer_state(tmp_path: Path) -> None:
    """--persist-every under async: each group persists its own directory (the outer
    state in it); the same command on the same --run-dir with more steps resumes every
    group from the newest step all of them hold (a boundary: its round is done again)
    and ends bit-identical to a run that was never stopped."""
    flags = ["--nproc-per-node", "2", "--strategy", "async", "--sync-every", "5"]
    flags += ["--persist-every", "10", str(EXAMPLE)]

    def run(run_dir: Path, steps: int, out: Path) -> list[str]:
        args = [*flags, "--steps", str(steps), "--out", str(out)]
        proc = stalwart_run(run_dir, args, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(Path(f"{out}.{p}").read_text())["params"] for p in (0, 1)]

    run(tmp_path / "run", 20, tmp_path / "first")
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == ["group0", "group1"]
    resumed = run(tmp_path / "run", 30, tmp_path / "resumed")
    rounds = [f["round"] for k, f in events_of(tmp_path / "run") if k == "replica_sync"]
    assert rounds == [4, 5, 6]  # resumed after step 20, whose round is done again
    assert resumed == run(tmp_path / "ref", 30, tmp_path / "ref")
