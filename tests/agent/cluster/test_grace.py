"""The partition grace (agent/cluster/_grace.py, docs/detection.md): a node whose lease expired in
silence is missing, not lost, for ``--partition-grace`` seconds; it rejoins when the link
heals, and the loss that lets the job move on is one transaction against its member key.

The pure parts with a fake clock and the memory store; then two real ``Cluster`` objects
in this process, node 1 reaching node 0's store through a forwarder the test cuts
(tests/agent/_forwarder.py), as tests/agent/cluster/test_fencing.py does.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stalwart.agent.cluster._cluster import Cluster, NodeFenced
from stalwart.agent.cluster._fencing import NodeLease
from stalwart.agent.cluster._grace import MissingNodes, RejoinClock, claim_lost
from stalwart.contract.env import WorkerEnv
from stalwart.coordinator import (
    BlocklistedError,
    Coordinator,
    CoordinatorConfig,
    MemoryStore,
    StoreUnavailableError,
)
from stalwart.runtime.comm._coord import worker_coordinator, worker_fence

from .._forwarder import Forwarder, forwarder
from .._launch import _free_port
from ._helpers import two_node_config

pytestmark = pytest.mark.timeout(180)
LEASE, GRACE = 1.0, 4.0


# -- the adopter's side: missing, then lost ------------------------------------------


def test_a_silent_expiry_is_lost_only_after_the_grace_a_loud_one_at_once() -> None:
    now, lines = [100.0], list[str]()
    missing = MissingNodes(5.0, lines.append, clock=lambda: now[0])
    quiet = lambda n: False  # noqa: E731
    assert missing.due({1}, {0}, quiet) == set()
    assert missing.waiting and "may rejoin within the partition grace (5.0 s)" in lines[0]
    now[0] = 104.9
    assert missing.due({1}, {0}, quiet) == set()
    now[0] = 105.0
    assert missing.due({1}, {0}, quiet) == {1}
    assert not missing.waiting
    # a death seen by the peer watch, a decided cut: no grace
    assert missing.due({2}, {0}, lambda n: n == 2) == {2}
    assert MissingNodes(0.0, lines.append).due({3}, {0}, quiet) == {3}


def test_a_node_back_within_the_grace_is_forgotten_and_said() -> None:
    now, lines = [0.0], list[str]()
    missing = MissingNodes(5.0, lines.append, clock=lambda: now[0])
    missing.due({1}, {0}, lambda n: False)
    now[0] = 3.0
    assert missing.due(set(), {0, 1}, lambda n: False) == set()
    assert (
        not missing.waiting
        and lines[-1] == "node 1 rejoined the job 3.00 s after its lease expired"
    )
    now[0] = 100.0  # lost again later: a new grace, from now
    assert missing.due({1}, {0}, lambda n: False) == set()


def _member(store: MemoryStore, root: str, node: int) -> int:
    lease = store.grant(30.0)
    store.put(f"{root}/members/node{node}", b"{}", lease)
    return lease


def test_the_loss_is_one_claim_against_the_member_key_and_the_blocklist() -> None:
    store, job = MemoryStore(), f"g-{uuid.uuid4().hex[:6]}"
    root, coord = f"/stalwart/{job}", Coordinator(MemoryStore(), CoordinatorConfig(job_id=job))
    coord = Coordinator(store, CoordinatorConfig(job_id=job, lease_ttl=30.0))
    lease = _member(store, root, 1)
    # node 1 rejoined (its key is there): the claim fails, nothing written
    assert not claim_lost(store, root, 1, by=0, fence=[])
    assert store.get(f"{root}/adopted/node1") is None and coord.blocklisted() == {}
    store.revoke(lease)
    assert claim_lost(store, root, 1, by=0, fence=[])
    assert json.loads(store.get(f"{root}/adopted/node1").value) == {"by": 0}  # type: ignore[union-attr]
    assert coord.blocklisted()["node1"].reason == "lease expired: node lost"
    assert not claim_lost(store, root, 1, by=0, fence=[])  # once
    with pytest.raises(BlocklistedError):  # too late to rejoin
        coord.join("node1")


def test_a_fenced_adopter_cannot_claim() -> None:
    store, job = MemoryStore(), f"g-{uuid.uuid4().hex[:6]}"
    coord = Coordinator(store, CoordinatorConfig(job_id=job, lease_ttl=30.0))
    member = coord.join("node0")
    fence = coord.fence_of(member)
    member.leave()  # node 0's own lease is gone
    assert not claim_lost(store, f"/stalwart/{job}", 1, by=0, fence=[fence.compare()])
    assert coord.blocklisted() == {}


def test_the_cut_nodes_deadline_comes_before_the_adopters_grace_ends() -> None:
    # the store renewed no earlier than the renewal was sent: it expires no earlier than
    # sent + lease, and the adopter declares the loss no earlier than grace after that
    assert RejoinClock.deadline(10.0, 3.0, 5.0) < 10.0 + 3.0 + 5.0
    now = [0.0]
    clock = RejoinClock(clock=lambda: now[0])
    assert clock.attempt(5.0) is True
    assert clock.attempt(5.0) is False  # spaced
    now[0] = 1.0
    assert clock.attempt(5.0) is True
    now[0] = 5.0
    assert clock.attempt(5.0) is None  # too late: fenced


# -- two real agents' clusters, node 1 cut from node 0's store -----------------------


NOTES: tuple[list[str], list[str]] = ([], [])  # what each agent would say


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Cluster, Cluster, Forwarder]]:
    job, port = f"grace-{uuid.uuid4().hex[:8]}", _free_port()
    NOTES[0].clear(), NOTES[1].clear()
    node0 = Cluster(
        two_node_config(tmp_path, job, 0, f"127.0.0.1:{port}", lease=LEASE, grace=GRACE),
        str(tmp_path),
        NOTES[0].append,
    )
    node0.start()
    with forwarder(("127.0.0.1", port)) as fwd:
        cfg1 = two_node_config(tmp_path, job, 1, f"127.0.0.1:{fwd.port}", lease=LEASE, grace=GRACE)
        node1 = Cluster(cfg1, str(tmp_path), NOTES[1].append)
        node1.start()
        try:
            yield node0, node1, fwd
        finally:
            fwd.heal()
            node1.close(goodbye=False)
            node0.close()
            for path in node0.names.everything():
                Path(path).unlink(missing_ok=True)


def _wait(predicate: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.02)


def _poll(cluster: Cluster) -> bool:
    """One agent poll of node 1 (agent.py's _poll_store): True once it holds a lease."""
    try:
        cluster.check_fenced(probe=False)
    except StoreUnavailableError:
        return False
    return cluster.lease.missing is None


def test_a_partition_shorter_than_the_grace_heals_into_the_same_job(
    nodes: tuple[Cluster, Cluster, Forwarder],
) -> None:
    node0, node1, fwd = nodes
    first = node1.lease.revision
    fwd.cut()
    lost: list[int] = []
    _wait(lambda: lost.extend(node0.lost_nodes()) or node0.live_nodes() == {0}, "expiry")
    _wait(lambda: node1.lease.missing is not None, "node 1 seeing its lease gone")
    fwd.heal()
    _wait(lambda: lost.extend(node0.lost_nodes()) or _poll(node1), "node 1 rejoining")
    assert node1.lease.lost_reason is None and node1.lease.revision > first  # a new key
    assert any("rejoined the job after its lease expired" in n for n in NOTES[1]), NOTES
    _wait(lambda: lost.extend(node0.lost_nodes()) or "rejoined the job" in str(NOTES[0]), "seen")
    assert "may rejoin within the partition grace" in NOTES[0][0], NOTES
    assert lost == [] and node0.blocklisted() == set()  # never lost, never blocklisted
    # the new lease guards its bumps (the same coordinator object, its fence moved); its
    # workers read the new fence from /dev/shm
    coord = node1.coord
    assert coord.fence is not None and coord.fence.create_revision == node1.lease.revision
    assert coord.advance_generation(coord.generation(), "a worker of node 1 crashed").won
    env = WorkerEnv(job=node1.cfg.job, fence=f"1:{first}", shm_run=node1.names.run)
    fence = worker_fence(env)
    assert fence is not None and fence.create_revision == node1.lease.revision
    worker = worker_coordinator(env, node0.store)
    assert worker.advance_generation(node0.coord.generation(), "a worker saw a collective fail").won


def test_a_lease_the_store_kept_is_resumed_not_joined_again(
    nodes: tuple[Cluster, Cluster, Forwarder],
) -> None:
    """Node 1's heartbeat gives up (its store calls time out) while the store still
    holds its lease: a coordinator that was slow, not away (a stalled store renews every
    lease when it runs again; coordinator/_stall.py), here renewed from node 0's side
    during the cut. At the heal node 1 finds its member key as it created it and resumes
    the same lease: no new member key, its workers' fence unchanged, never lost."""
    node0, node1, fwd = nodes
    _wait(lambda: node0.live_nodes() == {0, 1}, "node 1 seen")
    first = node1.lease.revision
    kv = node0.store.get(node1.lease.key)
    assert kv is not None and kv.create_revision == first
    stop = threading.Event()

    def renew() -> None:  # the store keeps node 1's lease through the cut
        while not stop.wait(LEASE / 4):
            node0.store.keepalive(kv.lease)

    keeper = threading.Thread(target=renew, daemon=True)
    keeper.start()
    try:
        fwd.cut()
        _wait(lambda: node1.lease.missing is not None, "node 1 seeing its lease gone")
        assert node0.store.get(node1.lease.key) is not None  # the store still has it
        fwd.heal()
        _wait(lambda: _poll(node1), "node 1 resuming")
    finally:
        stop.set()
        keeper.join()
    assert node1.lease.lost_reason is None and node1.lease.revision == first  # the same key
    assert any("renewed its lease again" in n for n in NOTES[1]), NOTES
    assert not any("rejoined the job after" in n for n in NOTES[1]), NOTES
    # its own heartbeat holds the lease again: alive several leases after the keeper
    t_end = time.monotonic() + 4 * LEASE
    while time.monotonic() < t_end:
        assert node0.lost_nodes() == [] and node0.live_nodes() == {0, 1}
        time.sleep(0.05)
    assert node0.blocklisted() == set() and NOTES[0] == []  # node 0 never missed it


def test_a_partition_longer_than_the_grace_loses_the_node_for_good(
    nodes: tuple[Cluster, Cluster, Forwarder],
) -> None:
    node0, node1, fwd = nodes
    fwd.cut()
    lost: list[int] = []
    _wait(lambda: lost.extend(node0.lost_nodes()) or lost, "node 1 declared lost")
    assert lost == [1] and "node1" in node0.coord.blocklisted()
    fwd.heal()
    with pytest.raises((NodeFenced, StoreUnavailableError)):
        _wait(lambda: _poll(node1) and False, "node 1 fenced")
    _wait(lambda: node1.lease.lost_reason is not None, "node 1 fenced")
    assert node0.live_nodes() == {0}  # it never came back


def test_the_lease_loss_of_a_grace_of_zero_is_final() -> None:
    lease = NodeLease(1)
    lease.joined("/stalwart/j/members/node1", 7)
    lease.expired("lease gone", RejoinClock.deadline(time.monotonic(), 1.0, 0.0))
    assert lease.missing is not None and lease.lost_reason is None
    lease.lost("blocklisted")
    assert lease.missing is None and lease.lost_reason == "blocklisted"


def test_a_node_that_cordoned_itself_stays_cordoned_when_its_adopter_claims_it(
    nodes: tuple[Cluster, Cluster, Forwarder],
) -> None:
    """A cordoned node leaves like a lost node (no goodbye) so that node 0 adopts its
    ranks; the claim must keep its own blocklist entry and node 0 must read it as
    cordoned (NodeLossDetector: no second isolation, no node_loss fault)."""
    node0, node1, _ = nodes
    _wait(lambda: node0.lost_nodes() == [] and node0.live_nodes() == {0, 1}, "node 1 seen")
    node1.coord.block("node1", "probe disk failed")
    node1.close(goodbye=False)
    lost: list[int] = []
    _wait(lambda: lost.extend(node0.lost_nodes()) or lost, "node 1 claimed")
    assert lost == [1]
    assert "node1" in node0.blocklisted()  # cordoned, not declared lost here
    assert node0.coord.blocklisted()["node1"].reason == "probe disk failed"
    assert json.loads(node0.store.get(f"/stalwart/{node0.cfg.job}/adopted/node1").value) == {
        "by": 0
    }
