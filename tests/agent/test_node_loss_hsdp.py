"""HSDP across 2 nodes (issue 15): a ("replicate", "shard") mesh of 2 x 2, each node one
replica group (examples/train_hsdp.py). Node 1 is lost (agent, workers, its /dev/shm
slots); node 0 adopts ranks 2 and 3, which restore their shards from ranks 0 and 1's
snapshot slots (the same shards, in the other replica group's memory): the ``peer``
tier, no disk and no replication. The final shards and optimizer moments of every rank
must equal a fault-free run's bit for bit. Plain FSDP2 (``--replicate 1``: every rank's
shards are its own) has no such copy: with ``--replica-rate`` each rank's shard is in its
buddy node's memory, and the lost ranks restore from there (the ``replica`` tier).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from coordinator.etcd_secure import SecureEtcd, running_secure_etcd

from stalwart.metrics.events import read_events

from ._launch import events_of, reap_agents, start_etcd_agents

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hsdp.py"
ARGS = ["--steps", "100", "--dim", "64", "--layers", "2", "--step-ms", "20"]

pytestmark = pytest.mark.timeout(600)  # two 2-node runs; imports alone take minutes under load


# the etcd a production job meets: TLS, client certificates, auth, a user per job
# (tests/coordinator/etcd_secure.py)
JOBS = [f"hsdp-{uuid.uuid4().hex[:8]}" for _ in range(8)]


@pytest.fixture(scope="module")
def etcd() -> Iterator[SecureEtcd]:
    with running_secure_etcd(jobs=JOBS) as secure:
        yield secure


def _run(
    etcd: SecureEtcd, run_dir: Path, extra: list[str], script: tuple[str, ...] = ()
) -> tuple[list[int], list[str]]:
    """2 agents x 2 workers; returns the exit codes and each rank's state digest."""
    job = JOBS.pop()
    url = etcd.job_url(job)
    out = run_dir.parent / f"{run_dir.name}.sha"
    procs = start_etcd_agents(
        url, run_dir, [*extra, str(EXAMPLE), *ARGS, *script, "--out", str(out)]
    )
    ended = reap_agents(procs, job, 280)
    for code, err in ended:
        assert code in (0, 137), err[-3000:]
    codes = [code for code, _ in ended]
    return codes, [Path(f"{out}.rank{r}").read_text() for r in range(4)]


def test_a_lost_node_restores_its_shards_from_the_other_replica_groups_memory(
    etcd: SecureEtcd, tmp_path: Path
) -> None:
    codes, reference = _run(etcd, tmp_path / "ref", [])
    assert codes == [0, 0]
    assert reference[0] == reference[2] and reference[1] == reference[3]  # replicas
    run_dir = tmp_path / "lost"
    codes, digests = _run(etcd, run_dir, ["--chaos", "kill node=1 at=step:50"])
    assert codes == [0, 137]
    assert digests == reference
    restores = [e for e in read_events(str(run_dir / "events.jsonl")).events if e.kind == "restore"]
    tiers = {int(str(e.rank)): (e["tier"], e.fields.get("source_rank")) for e in restores}
    assert tiers[2] == ("peer", 0) and tiers[3] == ("peer", 1), tiers
    assert tiers[0][0] == tiers[1][0] == "memory", tiers
    ends = [f for k, f in events_of(run_dir) if k == "recovery_end"]
    assert ends and all(f["source_tier"] == "peer" for f in ends), ends
    assert not (run_dir / "ckpt").exists() or not any((run_dir / "ckpt").rglob("*.json"))


def test_a_lost_node_restores_plain_fsdp2_shards_from_the_buddys_replica(
    etcd: SecureEtcd, tmp_path: Path
) -> None:
    fsdp = ("--replicate", "1")  # a (1, 4) mesh: FSDP2 over all 4 ranks
    codes, reference = _run(etcd, tmp_path / "ref", [], fsdp)
    assert codes == [0, 0] and len(set(reference)) == 4  # every rank's shards its own
    run_dir = tmp_path / "replica"
    # snapshots less often than a replication round, so the replica is one of the
    # survivors' two newest snapshots (docs/recovery.md)
    extra = ["--replica-rate", "200", "--snapshot-every", "15"]
    codes, digests = _run(etcd, run_dir, [*extra, "--chaos", "kill node=1 at=step:50"], fsdp)
    assert codes == [0, 137]
    assert digests == reference
    restores = [e for e in read_events(str(run_dir / "events.jsonl")).events if e.kind == "restore"]
    tiers = {int(str(e.rank)): str(e["tier"]) for e in restores}
    assert tiers[2] == tiers[3] == "replica", tiers  # node 1's shards, from node 0's memory
    assert tiers[0] == tiers[1] == "memory", tiers
