"""Network partitions between two hosts (issue 25): each cell a 2-host flash job of
examples/train_sharded.py (every rank's state its own, so a wrong restore shows in the
digests), started across lab hosts with the documented flags, a network fault injected
once rank 0 logged step FAULT_AT, and the cell's expected outcome:

* the majority side (node 0, which holds the coordinator and rank 0) finishes, rc 0;
* the job's final parameters are bit-identical to a fault-free 1-host run of the same
  world size;
* no step completes in an old generation after a bump (rank 0's step journal against
  the generation events: a split brain trains on in the old one);
* the newest committed checkpoint of every rank is the last persist step (the job's
  last step), and no process sees more than one of its commits refused (a fenced member
  stops at the first);
* the cut node exits 3 (fenced) or, where the fault healed, rejoins and ends 0;
* nothing is left in any host's /dev/shm, and the lab is removed (the fixtures).

The job, its fault-free reference (the session's ``reference`` fixture, conftest.py) and
these checks are _flash.py's; more cells of the matrix are in test_partition_matrix.py.

Marked ``hosts`` and ``matrix``: ``make test-matrix`` runs them (CI, after ``make test``);
``make test`` keeps the labs' own tests (test_faults.py, test_addresses.py).
Under etcd both nodes keep their leases: the partition is found by the watched data
plane (agent/_dataplane.py: every rank waits in a collective, the agents probe each other).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from coordinator.etcd_server import require_etcd

from ._etcd import etcd_on
from ._flash import ARGS, FAULT_AT, FLAGS, check_outcome
from ._job import STORE_PORT, HostJob
from ._lab import Lab

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]


def _faulted(
    lab: Lab, job: HostJob, fault: str, reference: list[str], *, timeout: float = 420
) -> tuple[int, str]:
    job.wait_step(FAULT_AT, timeout=240)
    lab.inject(fault)
    ended = job.wait(timeout)
    check_outcome(job, ended, reference)
    return ended[1]


@pytest.mark.matrix
def test_healthy_two_hosts_equal_one_host(
    lab_factory: Callable[..., Lab],
    jobs: Callable[..., HostJob],
    reference: list[str],
    tmp_path: Path,
) -> None:
    lab = lab_factory(2)
    job = jobs(lab, tmp_path, [0, 1], ARGS, flags=FLAGS)
    ended = job.wait(300)
    assert [rc for rc, _ in ended] == [0, 0], ended
    check_outcome(job, ended, reference)


@pytest.mark.matrix
def test_control_plane_cut_30s(
    lab_factory: Callable[..., Lab],
    jobs: Callable[..., HostJob],
    reference: list[str],
    tmp_path: Path,
) -> None:
    """Node 1 cannot reach node 0's store for 30 s; the data plane stays up."""
    lab = lab_factory(2)
    job = jobs(lab, tmp_path, [0, 1], ARGS, flags=FLAGS)
    rc1, err1 = _faulted(lab, job, f"partition 1->0:{STORE_PORT} for 30s", reference)
    assert rc1 in (0, 3), err1[-3000:]


@pytest.mark.matrix
def test_full_partition_30s_then_heal(
    lab_factory: Callable[..., Lab],
    jobs: Callable[..., HostJob],
    reference: list[str],
    tmp_path: Path,
) -> None:
    lab = lab_factory(2)
    job = jobs(lab, tmp_path, [0, 1], ARGS, flags=FLAGS)
    rc1, err1 = _faulted(lab, job, "partition 0<->1 for 30s", reference)
    assert rc1 in (0, 3), err1[-3000:]


@pytest.mark.matrix
def test_permanent_partition_majority_finishes(
    lab_factory: Callable[..., Lab],
    jobs: Callable[..., HostJob],
    reference: list[str],
    tmp_path: Path,
) -> None:
    lab = lab_factory(2)
    job = jobs(lab, tmp_path, [0, 1], ARGS, flags=FLAGS)
    rc1, err1 = _faulted(lab, job, "partition 0<->1", reference)
    assert rc1 == 3, err1[-3000:]


@pytest.mark.matrix
def test_permanent_partition_under_etcd(
    lab_factory: Callable[..., Lab],
    jobs: Callable[..., HostJob],
    reference: list[str],
    tmp_path: Path,
) -> None:
    """etcd on a third host both nodes still reach; the nodes cut from each other."""
    binary = require_etcd()
    lab = lab_factory(3)
    (tmp_path / "etcd").mkdir()
    with etcd_on(lab, 2, binary, tmp_path / "etcd" / "data") as addr:
        job = jobs(lab, tmp_path, [0, 1], ARGS, flags=FLAGS, rdzv=f"etcd://{addr}/hostjob")
        rc1, err1 = _faulted(lab, job, "partition 0<->1", reference, timeout=240)
        assert rc1 == 3, err1[-3000:]
