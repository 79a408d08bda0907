"""``--strategy elastic`` under ``--rdzv etcds://`` (a TLS etcd with client certificates
and auth, the job logged in as its own user: tests/coordinator/etcd_secure.py): node 1 is
lost for good (agent and workers SIGKILLed) and the job goes on with node 0's two workers,
no survivor restarted, then finishes; the same global batch every step (docs/elastic.md)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from coordinator.etcd_secure import SecureEtcd, running_secure_etcd

from ._launch import events_of, reap_agents, start_etcd_agents

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py"
ARGS = ["--steps", "40", "--dim", "32", "--layers", "1", "--seq", "16"]
ARGS += ["--global-batch", "24", "--micro-batch", "4", "--step-sleep", "0.05"]

pytestmark = pytest.mark.timeout(240)


JOBS = [f"el-{uuid.uuid4().hex[:8]}" for _ in range(2)]  # a user each, made at start


@pytest.fixture(scope="module")
def etcd() -> Iterator[SecureEtcd]:
    with running_secure_etcd(jobs=JOBS) as secure:
        yield secure


def test_elastic_job_survives_losing_a_node_for_good(etcd: SecureEtcd, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = JOBS.pop()
    url = etcd.job_url(job)
    flags = ["--nnodes", "1:2", "--strategy", "elastic"]
    flags += ["--chaos", "kill node=1 at=step:12 permanent"]
    procs = start_etcd_agents(url, run_dir, [*flags, str(EXAMPLE), *ARGS])
    ended = reap_agents(procs, job, 180)
    assert [code for code, _ in ended] == [0, 137], ended[0][1][-3000:]
    events = events_of(run_dir)
    resizes = [f for k, f in events if k == "resize"]
    assert [int(str(f["world_size"])) for f in resizes][-1] == 2, resizes
    assert all(int(str(f["global_batch"])) == 24 for f in resizes), resizes
    ends = [f for k, f in events if k == "run_end"]
    assert ends and ends[-1]["status"] == "ok", ends
    assert not [p for p in os.listdir("/dev/shm") if job in p], "shared memory left behind"
