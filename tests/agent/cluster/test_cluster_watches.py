"""What an agent looks at often comes from watches (agent/cluster/_follow.py), not a
request per look: the live nodes and the verdict another node ended the job with (issue
31). Two real ``Cluster`` objects in this process, node 1 over TCP to node 0's store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _load import wait_until

from stalwart.agent.cluster._cluster import Cluster
from stalwart.agent.detection._finished import FINISHED, finished_rank, finishing_rank

from .._launch import _free_port
from ._helpers import CountingStore, two_node_config

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Cluster, Cluster, CountingStore]]:
    job, port = f"watches-{uuid.uuid4().hex[:8]}", _free_port()
    node0 = Cluster(
        two_node_config(tmp_path, job, 0, f"127.0.0.1:{port}", lease=2.0), str(tmp_path)
    )
    node0.start()
    node1 = Cluster(
        two_node_config(tmp_path, job, 1, f"127.0.0.1:{port}", lease=2.0), str(tmp_path)
    )
    node1.start()
    counting = node1.store = CountingStore(node1.store)
    try:
        yield node0, node1, counting
    finally:
        node1.close()
        node0.close()


def test_looks_at_the_verdict_and_the_live_nodes_cost_no_request(
    nodes: tuple[Cluster, Cluster, CountingStore],
) -> None:
    node0, node1, counting = nodes

    def quiet() -> bool:  # a hundred of the agent's looks: a request at most
        before = counting.requests
        for _ in range(100):
            assert node1.published_verdict() is None
            assert node1.live_nodes() == {0, 1}
        return counting.requests - before <= 1

    assert wait_until(quiet, 30)  # once the watches are open (a request per look before)
    node0.publish("verdict", {"line": "rank 3: NaN loss at step 12"})
    assert wait_until(lambda: node1.published_verdict() is not None, 30)
    assert node1.published_verdict() == "rank 3: NaN loss at step 12"


def test_the_finish_looked_at_every_turn_of_the_loop_costs_no_request(
    nodes: tuple[Cluster, Cluster, CountingStore],
) -> None:
    """The exit watch asks on every turn of the agent's 20 ms loop whether a rank
    finished the job (agent/detection/_finished.py): a read per look was 50 requests a
    second per node. From a watch it is none; the record still arrives."""
    node0, node1, counting = nodes

    def quiet() -> bool:
        before = counting.requests
        for _ in range(100):
            assert finishing_rank(_NoLocal(), node1, 4) is None
        return counting.requests - before <= 1

    assert wait_until(quiet, 30)
    node0.publish(FINISHED, {"rank": 2, "node": 1})
    assert wait_until(lambda: finishing_rank(_NoLocal(), node1, 4) == 2, 30)
    assert finished_rank(_NoLocal(), node1, 4, besides=2) is None  # a fresh read, besides


class _NoLocal:
    def finished_peer(self, rank: int) -> int | None:
        return None
