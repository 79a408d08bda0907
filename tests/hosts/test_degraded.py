"""A degraded link between two hosts (issue 25, item 8): 30% loss both ways for 30 s
under a 2-host flash job of examples/train_sharded.py. The link passes traffic, so no
node is lost and nothing is recovered: the job runs on at the link's pace, and

* the agents say so: a ``link_degraded`` event (the step rate collapsed while every
  rank computed as before, agent/detection/degraded.py) naming the far node, and a
  ``link_recovered`` once the loss healed;
* the job finishes rc 0 on both hosts, its final parameters bit-identical to a
  fault-free 1-host run of the same world size, every rank's newest checkpoint at the
  last step, no step in an old generation, nothing left in /dev/shm.

Under ``--on-degraded evict`` the node holding rank 0 (node 0) evicts node 1 instead: node
1 is fenced and exits 3, its ranks adopted on node 0 (flash), still bit-identical.

Marked ``matrix`` (``make test-matrix``), as the partition matrix's cells.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stalwart.metrics.events import Event, read_events

from ._job import HostJob, newest_checkpoint, old_generation_steps, refused_commits
from ._lab import Lab
from .conftest import require_lab

STEPS = 500
ARGS = ["--steps", str(STEPS), "--size-mb", "2", "--window-mb", "0.25", "--step-ms", "60"]
FLAGS = ["--strategy", "flash", "--persist-every", "100"]
# 30% loss makes a 3 s lease's renewals time out (a request bound of half the lease, then
# a reconnect whose SYNs are lost too): at the default lease node 1 was lost during the
# fault; with the partition grace (5 s) both agents declared the link degraded first, but
# node 1 could not rejoin within the grace over the lossy link and was still evicted
# (docs/detection.md, one run). A 10 s lease rode the loss out in most runs, not all: in
# a CI run node 1's lease expired 15 s into the fault (a renewal that waits 5 s for a
# segment TCP retransmits with backoff, then a reconnect). Under `report` the test is
# about the link, so it takes a 20 s lease: a renewal has two 10 s tries per lease.
# `evict` ends node 1 itself and keeps 10 s.
LEASE = {"report": ["--node-lease", "20"], "evict": ["--node-lease", "10"]}
FAULT_AT = 150  # past the detector's learning (3 windows of 3 s) on a loaded machine
WORLD = 4

pytestmark = [pytest.mark.hosts, pytest.mark.matrix, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The digests of a fault-free 1-host run with the same world size (4 workers)."""
    require_lab()
    with Lab(1) as lab:
        job = HostJob(lab, tmp_path_factory.mktemp("ref"), [0], ARGS, FLAGS, nproc=WORLD)
        try:
            job.start()
            ended = job.wait(300)
        finally:
            job.stop()
    assert [rc for rc, _ in ended] == [0], ended
    return job.digests()


def _degraded_run(
    lab_factory: Callable[..., Lab], jobs: Callable[..., HostJob], work: Path, flags: list[str]
) -> tuple[HostJob, list[tuple[int, str]], list[Event]]:
    lab = lab_factory(2)
    lease = LEASE["evict" if "evict" in flags else "report"]
    job = jobs(lab, work, [0, 1], ARGS, flags=FLAGS + lease + flags)
    job.wait_step(FAULT_AT, timeout=240)
    # evict: 60 s. With hedged renewals node 1 keeps its lease through the loss, so the
    # node is lost only by node 0's verdict; in one run of four node 0 had not declared
    # the link degraded within 30 s and the job ran through the loss unevicted (rc 0, 0)
    lab.inject(f"loss 0<->1 30% for {60 if 'evict' in flags else 30}s")
    ended = job.wait(600)
    return job, ended, read_events(str(job.run_dir / "events.jsonl")).events


def _same_result(job: HostJob, reference: list[str], events: list[Event]) -> None:
    assert job.digests() == reference
    assert old_generation_steps(job) == []
    repeated = {k: v for k, v in refused_commits(job.run_dir).items() if len(v) > 1}
    assert repeated == {}, f"commits refused in silence, (rank, pid) -> steps: {repeated}"
    for rank in range(WORLD):
        assert newest_checkpoint(job.run_dir, rank) == STEPS, f"rank {rank}"
    assert job.shm_left() == {}
    assert [e["status"] for e in events if e.kind == "run_end"] == ["ok"]


def test_loss_30_percent_for_30s_is_seen_and_the_job_finishes_bit_identical(
    lab_factory: Callable[..., Lab],
    jobs: Callable[..., HostJob],
    reference: list[str],
    tmp_path: Path,
) -> None:
    job, ended, events = _degraded_run(lab_factory, jobs, tmp_path, [])
    (rc0, err0), (rc1, err1) = ended
    assert (rc0, rc1) == (0, 0), (
        f"node 0 rc {rc0}:\n{err0[-3000:]}\nnode 1 rc {rc1}:\n{err1[-3000:]}"
    )
    _same_result(job, reference, events)
    degraded = [e for e in events if e.kind == "link_degraded"]
    assert degraded, f"no link_degraded event; node 0 said:\n{err0[-3000:]}"
    by_node = {e["domain"]["node"]: e for e in degraded}
    assert by_node.get(0) is not None and by_node[0]["peers"] == [1], degraded
    assert by_node[0]["ratio"] >= 3 and by_node[0]["action"] == "report"
    assert "is degraded" in err0  # the line
    recovered = [e for e in events if e.kind == "link_recovered"]
    assert recovered, f"no link_recovered event; node 0 said:\n{err0[-3000:]}"
    # nobody was lost (a straggler report is a rank's compute on this loaded machine,
    # not the link: the link's own verdict is the link_degraded event above)
    lost = [e for e in events if e.kind == "fault_detected" and e["fault"] != "straggler"]
    assert not lost, lost


def test_evict_fences_the_far_node_and_the_job_finishes_bit_identical(
    lab_factory: Callable[..., Lab],
    jobs: Callable[..., HostJob],
    reference: list[str],
    tmp_path: Path,
) -> None:
    job, ended, events = _degraded_run(lab_factory, jobs, tmp_path, ["--on-degraded", "evict"])
    (rc0, err0), (rc1, err1) = ended
    assert (rc0, rc1) == (0, 3), (
        f"node 0 rc {rc0}:\n{err0[-3000:]}\nnode 1 rc {rc1}:\n{err1[-3000:]}"
    )
    _same_result(job, reference, events)
    evicting = [e for e in events if e.kind == "link_degraded" and e["action"] == "evict"]
    assert [e["domain"]["node"] for e in evicting] == [0], evicting
    lost = [e for e in events if e.kind == "fault_detected" and e["fault"] == "node_loss"]
    assert [e["domain"]["node"] for e in lost] == [1]
    assert "link degraded" in lost[0]["how"]
