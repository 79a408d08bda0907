"""``--strategy async`` end to end: 2 replica groups of one worker on loopback, group 1
killed between two synchronisations. The job finishes; group 0 decides the next round
without waiting for group 1 (``replica_sync`` with group 1 dropped), group 1 is started
again and rejoins at a sync boundary with the global state (``replica_rejoin``), takes
part in the rounds after it, and both groups end with the same parameters (the last
step is a sync boundary)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

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
    # back already (it rejoined with round 2's state and took part in round 3); the
    # round right after its rejoin may have been decided before it announced itself
    # (it then adopted that round's result), every later one has it
    dropped = [r for r, f in syncs.items() if f["dropped"] == [1]]
    last = rejoin["round"] + (rejoin["round"] + 1 in dropped)
    assert dropped == list(range(3, last + 1)), (rejoin, syncs)
    assert all(syncs[r]["members"] == [0, 1] for r in syncs if r > last)
    assert any(k == "recovery_end" and f["source_tier"] == "transfer" for k, f in events)

    finals = _finals(out, range(2), proc, run_dir)
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


@pytest.mark.timeout(300)
def test_a_replica_group_of_two_restarts_as_one(tmp_path: Path) -> None:
    """--replica-groups 2 of 4 workers (each group a DDP group of 2): rank 1 is killed,
    so group 0 is dropped, both its members start again (no job generation ends, group
    1 keeps its processes) and rejoin; every worker ends with the same parameters."""
    run_dir, out = tmp_path / "run", tmp_path / "final"
    args = ["--nproc-per-node", "4", "--strategy", "async", "--replica-groups", "2"]
    args += ["--sync-every", "5", "--chaos", "kill rank=1 at=step:14"]
    args += [str(EXAMPLE), "--steps", "30", "--step-sleep", "0.05", "--out", str(out)]
    proc = stalwart_run(run_dir, args, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    events = events_of(run_dir)
    assert [(f["group"], f["cause"]) for k, f in events if k == "replica_drop"] == [(0, "crash")]
    (rejoin,) = [f for k, f in events if k == "replica_rejoin"]  # the group's leader's
    syncs = {f["round"]: f for k, f in events if k == "replica_sync"}
    # back in the rounds after its rejoin (the round right after it may have been
    # decided before it announced itself: it then adopted that round's result)
    assert all(syncs[r]["members"] == [0, 1] for r in syncs if r > rejoin["round"] + 1), syncs
    assert syncs[max(syncs)]["members"] == [0, 1]
    ends = [f for k, f in events if k == "recovery_end"]
    assert [(f["source_tier"], f["generation"]) for f in ends] == [("transfer", 0)]
    finals = {f["params"] for f in _finals(out, range(4), proc, run_dir)}
    assert len(finals) == 1


@pytest.mark.timeout(200)
def test_groups_seeded_by_rank_start_from_one_model(tmp_path: Path) -> None:
    """A script seeding its model by rank (nanoGPT's 1337 + rank): every group starts
    from group 0's parameters (round 0), so DiLoCo's outer step, which each group
    computes from its start, agrees: both end with the same parameters."""
    out = tmp_path / "final"
    args = ["--nproc-per-node", "2", "--strategy", "async", "--sync-every", "5"]
    args += [str(EXAMPLE), "--steps", "10", "--seed-by-rank", "--out", str(out)]
    proc = stalwart_run(tmp_path / "run", args, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    finals = {f["params"] for f in _finals(out, range(2), proc, tmp_path / "run")}
    assert len(finals) == 1


def _finals(
    out: Path, parts: range, proc: subprocess.CompletedProcess[str], run_dir: Path
) -> list[dict[str, Any]]:
    """Each part's final record; a job that ended ok without one of them is a silently
    wrong result: say what the job did (it was seen once, under two test runs at once,
    after 365 s: its output is what the next occurrence needs)."""
    missing = [part for part in parts if not Path(f"{out}.{part}").exists()]
    if missing:
        kinds = [
            f"{kind} {fields.get('rank', '')} {fields.get('group', '')} {fields.get('reason', '')}"
            for kind, fields in events_of(run_dir)
            if kind not in ("snapshot", "loss", "probe")
        ]
        raise AssertionError(
            f"rc {proc.returncode} but no final of part(s) {missing}; events:\n"
            + "\n".join(kinds[-60:])
            + f"\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return [json.loads(Path(f"{out}.{part}").read_text()) for part in parts]
