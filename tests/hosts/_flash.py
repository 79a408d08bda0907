"""The flash job of the partition cells (test_partition.py, test_partition_matrix.py):
examples/train_sharded.py with every rank's state its own (a wrong restore shows in the
digests), its fault-free reference, and the outcome every flash cell must have."""

from __future__ import annotations

from pathlib import Path

from stalwart.metrics.events import read_events

from ._job import HostJob, newest_checkpoint, old_generation_steps, refused_commits
from ._lab import Lab

__all__ = ["ARGS", "FAULT_AT", "FLAGS", "STEPS", "WORLD", "check_outcome", "fault_free_digests"]

STEPS = 600
ARGS = ["--steps", str(STEPS), "--size-mb", "2", "--window-mb", "0.25", "--step-ms", "60"]
FLAGS = ["--strategy", "flash", "--persist-every", "100"]
FAULT_AT = 60
WORLD = 4


def fault_free_digests(work: Path) -> list[str]:
    """The digests of a fault-free 1-host run with the same world size (4 workers)."""
    with Lab(1) as lab:
        job = HostJob(lab, work, [0], ARGS, FLAGS, nproc=WORLD)
        try:
            job.start()
            ended = job.wait(300)
        finally:
            job.stop()
    assert [rc for rc, _ in ended] == [0], ended
    return job.digests()


def check_outcome(job: HostJob, ended: list[tuple[int, str]], reference: list[str]) -> None:
    """Node 0 (the majority: the coordinator and rank 0) ends 0; the final parameters are
    the fault-free run's; no step in an old generation after a bump; no process saw more
    than one refused commit; every rank's newest checkpoint is the last step; nothing
    left in /dev/shm; one run in one run dir, ending ``ok``."""
    (rc0, err0), (_rc1, err1) = ended
    assert rc0 == 0, f"node 0 (majority) rc {rc0}:\n{err0[-3000:]}\nnode 1:\n{err1[-2000:]}"
    assert job.digests() == reference
    late = old_generation_steps(job)
    assert late == [], f"{len(late)} steps in an old generation after a bump: {late[:3]}"
    repeated = {k: v for k, v in refused_commits(job.run_dir).items() if len(v) > 1}
    assert repeated == {}, f"commits refused in silence, (rank, pid) -> steps: {repeated}"
    for rank in range(WORLD):
        assert newest_checkpoint(job.run_dir, rank) == STEPS, f"rank {rank}"
    assert job.shm_left() == {}
    # one run in one run dir, not the first host's records moved aside (issue 25, item 6)
    assert not (job.run_dir / "prev").exists()
    events = read_events(str(job.run_dir / "events.jsonl"))
    kinds = [e.kind for e in events.events]
    assert kinds.count("run_start") == 1, kinds
    assert [e["status"] for e in events.events if e.kind == "run_end"] == ["ok"]
