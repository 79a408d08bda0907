"""A worker follows the generation under the embedded store too, moves it only while
its agent holds its lease, and is never silent when fenced (runtime/comm/_coord.py,
runtime/comm/_fenced.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from stalwart.contract.env import WorkerEnv
from stalwart.coordinator import (
    Coordinator,
    CoordinatorConfig,
    StoreClient,
    StoreClientConfig,
    StoreServer,
)
from stalwart.errors import CheckpointError, FencedError
from stalwart.runtime.comm._coord import GenerationWatch, fence_compares, worker_fence
from stalwart.runtime.comm._fenced import FENCED_EXIT, CommitRefusals, stop_if_fenced

TOKEN = b"0123456789abcdef0123456789abcdef"
CFG = CoordinatorConfig(job_id="job", lease_ttl=1.0, heartbeat_interval=0.2)
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def served() -> Iterator[tuple[StoreServer, StoreClient]]:
    """The embedded backend as a worker sees it: node 0's server, a TCP client."""
    with StoreServer(TOKEN) as server:
        config = StoreClientConfig(request_timeout=10.0, reconnect_timeout=5.0)
        with StoreClient("127.0.0.1", server.port, TOKEN, config) as client:
            yield server, client


def _env(fence: str, rank: int = 2) -> WorkerEnv:
    return WorkerEnv(job="job", rank=rank, world_size=4, fence=fence)


def test_the_worker_fence_is_its_agents_member_key() -> None:
    fence = worker_fence(_env("1:17"))
    assert fence is not None
    assert (fence.key, fence.create_revision) == ("/stalwart/job/members/node1", 17)
    assert fence.holder == "rank 2 of node 1"
    assert worker_fence(_env("")) is None and fence_compares(_env("")) == []
    assert worker_fence(_env("1:0")) is None  # no key has revision 0


def test_a_bump_under_the_embedded_store_stops_an_old_generation_worker(
    served: tuple[StoreServer, StoreClient],
) -> None:
    server, client = served
    leader = Coordinator(server.store, CFG)
    node0 = leader.join("node0")
    watch = GenerationWatch(Coordinator(client, CFG), interval_s=30.0)  # the watch, not a read
    try:
        watch.follow(0)
        assert not watch.moved.is_set()
        leader.as_member(leader.fence_of(node0)).advance_generation(0, "node 1 lost")
        assert watch.moved.wait(30.0)  # the step loop leaves generation 0 at its boundary
        watch.follow(1)
        assert not watch.moved.is_set()
    finally:
        watch.close()
        node0.leave()


def test_workers_of_a_node_whose_lease_is_gone_cannot_move_the_job(
    served: tuple[StoreServer, StoreClient], caplog: pytest.LogCaptureFixture
) -> None:
    server, client = served
    agents = Coordinator(server.store, CFG)
    node1 = agents.join("node1")
    fence = f"1:{agents.fence_of(node1).create_revision}"
    worker = Coordinator(client, CFG, fence=worker_fence(_env(fence)))
    assert worker.advance_generation(0, "a collective failed").won  # its agent is live
    node1.leave()  # node 1 cut from the store: its lease is gone
    with pytest.raises(SystemExit) as exited, stop_if_fenced(lambda: 2):
        worker.advance_generation(1, "a collective failed")
    assert exited.value.code == FENCED_EXIT
    assert agents.generation() == 1  # nothing moved
    lines = [r.getMessage() for r in caplog.records if r.name == "stalwart.runtime"]
    assert len(lines) == 1 and "rank 2 stops, fenced: rank 2 of node 1 cannot" in lines[0]


@dataclass
class _Position:
    rank: int = 0
    generation: int = 3


def test_a_commit_refused_as_fenced_is_said_once_and_the_generation_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    left = threading.Event()
    commits = CommitRefusals(_Position(), left.set)
    commits.refused(CheckpointError("disk full"), 40, 3)  # not a fence: persist_end says it
    assert not left.is_set() and not caplog.records
    commits.refused(FencedError("generation 3 is stale"), 40, 3)
    commits.refused(FencedError("generation 3 is stale"), 60, 3)
    assert left.is_set()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "rank 0: the checkpoint of step 40 was refused" in lines[0]
    assert "leaving it to rejoin" in lines[0]


def test_a_refused_commit_of_a_generation_already_left_does_not_leave_the_new_one() -> None:
    left = threading.Event()
    CommitRefusals(_Position(generation=4), left.set).refused(FencedError("stale"), 40, 3)
    assert not left.is_set()
