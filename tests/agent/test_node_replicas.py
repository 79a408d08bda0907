"""Peer memory replicas (issue 7): a whole node is lost (agent, workers and its /dev/shm
slots); its buddy adopts its ranks and restores them from the replica in its memory, no
disk read; without a complete replica they come from the persisted checkpoint. The
job's state is different on every rank (examples/train_sharded.py), so no peer's
snapshot can stand in, and the final state must equal a fault-free run's bit for bit.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from coordinator.etcd_secure import SecureEtcd, running_secure_etcd

from stalwart.metrics.events import read_events

from ._launch import events_of, reap_agents, start_etcd_agents

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py"
ARGS = ["--steps", "160", "--size-mb", "2", "--window-mb", "0.25", "--step-ms", "20"]
KILL = ["--chaos", "kill node=1 at=step:60"]

pytestmark = pytest.mark.timeout(240)


# the etcd a production job meets: TLS, client certificates, auth, a user per job
# (tests/coordinator/etcd_secure.py)
JOBS = [f"rep-{uuid.uuid4().hex[:8]}" for _ in range(8)]


@pytest.fixture(scope="module")
def etcd() -> Iterator[SecureEtcd]:
    with running_secure_etcd(jobs=JOBS) as secure:
        yield secure


def _run(etcd: SecureEtcd, run_dir: Path, extra: list[str]) -> tuple[list[int], list[str]]:
    """2 agents x 2 workers; returns the exit codes and each rank's state digest."""
    job = JOBS.pop()
    url = etcd.job_url(job)
    out = run_dir.parent / f"{run_dir.name}.sha"
    # snapshots less often than a replication round, so the replica is one of the
    # survivors' two newest snapshots (docs/recovery.md)
    procs = start_etcd_agents(
        url,
        run_dir,
        ["--snapshot-every", "15", *extra, str(EXAMPLE), *ARGS, "--out", str(out)],
    )
    ended = reap_agents(procs, job, 150)
    for code, err in ended:
        assert code in (0, 137), err[-3000:]
    codes = [code for code, _ in ended]
    return codes, [Path(f"{out}.rank{r}").read_text() for r in range(4)]


@pytest.fixture(scope="module")
def reference(etcd: SecureEtcd, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    codes, digests = _run(etcd, tmp_path_factory.mktemp("ref") / "ref", [])
    assert codes == [0, 0]
    return digests


def _restores(run_dir: Path) -> dict[int, str]:
    """rank -> the tier its (last) restore came from."""
    res = read_events(str(run_dir / "events.jsonl"))
    return {
        int(e.rank): str(e["tier"])
        for e in res.events
        if e.kind == "restore" and e.rank is not None
    }


def test_lost_node_restores_from_the_buddys_replica(
    etcd: SecureEtcd, reference: list[str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "replica"
    codes, digests = _run(etcd, run_dir, ["--replica-rate", "200", *KILL])
    assert codes == [0, 137]
    assert digests == reference
    tiers = _restores(run_dir)
    assert tiers[2] == tiers[3] == "replica", tiers  # node 1's ranks, from node 0's memory
    assert tiers[0] == tiers[1] == "memory", tiers
    assert not (run_dir / "ckpt").exists() or not any((run_dir / "ckpt").rglob("*.json"))
    notes = [str(f["message"]) for k, f in events_of(run_dir) if k == "note"]
    assert any("take over their replicas" in n for n in notes)


def test_without_a_complete_replica_the_lost_node_restores_from_disk(
    etcd: SecureEtcd, reference: list[str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "disk"
    # a cap so low that no copy completes: the buddy holds nothing usable
    extra = ["--replica-rate", "0.001", "--persist-every", "10", *KILL]
    codes, digests = _run(etcd, run_dir, extra)
    assert codes == [0, 137]
    assert digests == reference
    tiers = _restores(run_dir)
    assert tiers[2] == tiers[3] == "disk", tiers  # node 1's ranks: nothing in memory
    # the survivors read the agreed step from their own snapshot when it holds it
    assert {tiers[0], tiers[1]} <= {"disk", "memory"}, tiers
    ends = [f for k, f in events_of(run_dir) if k == "recovery_end"]
    assert ends and all(f["source_tier"] == "disk" for f in ends), ends


def test_standbys_resume_the_lost_nodes_ranks(
    etcd: SecureEtcd, reference: list[str], tmp_path: Path
) -> None:
    """With --standby, node 0 already runs ranks 2 and 3 parked before their first step:
    the lost node's ranks resume in those processes (no process started), from the
    replica, and the result is the fault-free run's."""
    run_dir = tmp_path / "standby"
    # later than KILL: the standbys start after the first step; give them time to exist
    kill = ["--chaos", "kill node=1 at=step:110"]
    codes, digests = _run(etcd, run_dir, ["--replica-rate", "200", "--standby", *kill])
    assert codes == [0, 137]
    assert digests == reference
    res = read_events(str(run_dir / "events.jsonl"))
    joins = [e for e in res.events if e.kind == "member_join" and e.fields.get("standby")]
    assert sorted(int(str(e.rank)) for e in joins) == [2, 3], joins
    assert all(e.node == 0 for e in joins)
    tiers = _restores(run_dir)
    assert tiers[2] == tiers[3] == "replica", tiers
