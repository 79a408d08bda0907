"""An agent cut from node 0's store learns it is fenced within a bound set by its lease,
not after a 30 s request timeout plus a 30 s reconnect; healed, it cannot move the job's
generation (issue 25, items 2 and 5). Two real ``Cluster`` objects in this process, node
1 reaching node 0's store through a forwarder the test cuts (tests/agent/_forwarder.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.agent.cluster._cluster import Cluster, NodeFenced
from stalwart.agent.cluster._link import FENCE_BOUND_LEASES, Waiting, agent_client_config
from stalwart.coordinator import StoreUnavailableError
from stalwart.errors import FencedError

from .._forwarder import Forwarder, forwarder
from .._launch import _free_port
from ._helpers import two_node_config

LEASE = 1.0
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Cluster, Cluster, Forwarder]]:
    job, port = f"fence-{uuid.uuid4().hex[:8]}", _free_port()
    node0 = Cluster(
        two_node_config(tmp_path, job, 0, f"127.0.0.1:{port}", lease=LEASE), str(tmp_path)
    )
    node0.start()
    with forwarder(("127.0.0.1", port)) as fwd:
        node1 = Cluster(
            two_node_config(tmp_path, job, 1, f"127.0.0.1:{fwd.port}", lease=LEASE), str(tmp_path)
        )
        node1.start()
        try:
            yield node0, node1, fwd
        finally:
            fwd.heal()
            node1.close(goodbye=False)
            node0.close()


def _wait(predicate: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.02)


def test_the_agents_store_calls_are_bounded_by_the_lease() -> None:
    config = agent_client_config(3.0)
    assert config.request_timeout == 1.5 and config.reconnect_timeout == 6.0
    # a first timeout, two leases of retries, a last attempt: the documented bound
    bound = config.request_timeout + config.reconnect_timeout + config.request_timeout
    assert bound == FENCE_BOUND_LEASES * 3.0


def test_a_node_cut_from_the_store_is_fenced_before_it_recovers_anything(
    nodes: tuple[Cluster, Cluster, Forwarder],
) -> None:
    node0, node1, fwd = nodes
    assert not node1.fenced() and node0.live_nodes() == {0, 1}
    fwd.cut()
    t0 = time.monotonic()
    # the probe before a recovery: a bounded call that ends as fenced
    with pytest.raises((NodeFenced, StoreUnavailableError)) as raised:
        node1.check_fenced(probe=True)
    waited = time.monotonic() - t0
    ended = node1.fenced_if_cut(raised.value)
    assert isinstance(ended, NodeFenced) and "node 1 was fenced" in str(ended)
    # far below the 30 s + 30 s a call took before: the bound is 3 leases (3 s here)
    assert waited < 30.0, waited
    _wait(lambda: node0.live_nodes() == {0}, "expiry of node 1's lease in node 0's store")


def test_a_healed_node_whose_lease_expired_cannot_move_the_generation(
    nodes: tuple[Cluster, Cluster, Forwarder],
) -> None:
    node0, node1, fwd = nodes
    fwd.cut()
    _wait(lambda: node0.live_nodes() == {0}, "expiry of node 1's lease in node 0's store")
    assert node0.coord.advance_generation(0, "node 1 lost").won  # the live side moves on
    fwd.heal()  # node 1 is back, not yet aware it was fenced
    _wait(lambda: _answers(node1), "node 1 reaching the store again")
    with pytest.raises(FencedError) as refused:  # its bump checks its lease: gone
        node1.coord.advance_generation(1, "a worker of node 1 crashed")
    ended = node1.fenced_if_cut(refused.value)  # how the agent's loop ends on it
    assert isinstance(ended, NodeFenced) and "node 1 was fenced" in str(ended)
    with pytest.raises(NodeFenced):
        node1.check_fenced(probe=False)  # it knows now, before anything else
    assert node0.coord.generation() == 1  # unchanged: the stale agent moved nothing


def test_a_refused_bump_anywhere_in_the_agent_ends_it_as_fenced(
    nodes: tuple[Cluster, Cluster, Forwarder],
) -> None:
    _, node1, _ = nodes
    ended = node1.fenced_if_cut(FencedError("node1 cannot move the job past generation 2"))
    assert isinstance(ended, NodeFenced) and "generation 2" in str(ended)
    assert node1.lease.lost_reason is not None


def _answers(cluster: Cluster) -> bool:
    try:
        cluster.store.ping()
    except StoreUnavailableError:
        return False
    return True


def test_a_long_wait_says_once_what_it_waits_for_and_until_when(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    waiting = Waiting("node 0's store", deadline=220.0, clock=lambda: now[0])
    caplog.set_level("INFO", logger="stalwart")
    waiting.tick()
    now[0] = 109.0
    waiting.tick()
    assert not caplog.records  # under 10 s: nothing to say yet
    now[0] = 111.0
    waiting.tick()
    now[0] = 150.0
    waiting.tick()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("waiting for node 0's store until "), lines


def test_the_store_hosts_own_lease_never_lapses(tmp_path: Path) -> None:
    """Node 0 hosts the embedded store: its agent and the store live and die together,
    so its lease lapsing could only mean its heartbeat thread was starved (a single-node
    job fenced itself so at load 100+). Here its heartbeat stops for 4 leases: node 0 is
    not fenced, its member key stays; node 1's lease, under the same silence, lapses."""
    job, port = f"pin-{uuid.uuid4().hex[:8]}", _free_port()
    node0 = Cluster(
        two_node_config(tmp_path, job, 0, f"127.0.0.1:{port}", lease=LEASE), str(tmp_path)
    )
    node0.start()
    node1 = Cluster(
        two_node_config(tmp_path, job, 1, f"127.0.0.1:{port}", lease=LEASE), str(tmp_path)
    )
    node1.start()
    try:
        for node in (node0, node1):
            node._member._stop.set()  # the heartbeat threads end: no keepalive any more
            node._member._thread.join(timeout=30)
        _wait(lambda: node1.fenced(), "lapse of node 1's lease")
        t_lapse = time.monotonic()
        _wait(lambda: time.monotonic() - t_lapse > 3 * LEASE, "three more leases")
        assert not node0.fenced()
        assert node0.store.get(node0.lease.key) is not None
    finally:
        node1.close(goodbye=False)
        node0.close()
