"""What an agent looks at often comes from watches (agent/cluster/_follow.py), not a
request per look: the live nodes and the verdict another node ended the job with (issue
31). Two real ``Cluster`` objects in this process, node 1 over TCP to node 0's store."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _load import wait_until

from stalwart.agent.cluster._cluster import Cluster
from stalwart.agent.config import LaunchConfig

from .._launch import _free_port

pytestmark = pytest.mark.timeout(180)


class _Counting:
    """node 1's store client, counting its requests (a watch's every get included)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.requests = inner, 0
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.requests += 1

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr) or name == "close":
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._count()
            out = attr(*args, **kwargs)
            return _CountedWatch(out, self) if name == "watch" else out

        return counted


class _CountedWatch:
    def __init__(self, inner: Any, owner: _Counting) -> None:
        self.inner, self.owner = inner, owner

    def get(self, timeout: float | None = None) -> Any:
        self.owner._count()
        return self.inner.get(timeout)

    def close(self) -> None:
        self.inner.close()


def _config(tmp: Path, job: str, node: int, endpoint: str) -> LaunchConfig:
    script = tmp / "train.py"
    script.write_text("")
    return LaunchConfig(
        str(script),
        job=job,
        nnodes=2,
        node_rank=node,
        rdzv_endpoint=endpoint,
        node_lease_s=2.0,
        token_file=str(tmp / "token"),
    )


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Cluster, Cluster, _Counting]]:
    job, port = f"watches-{uuid.uuid4().hex[:8]}", _free_port()
    node0 = Cluster(_config(tmp_path, job, 0, f"127.0.0.1:{port}"), str(tmp_path))
    node0.start()
    node1 = Cluster(_config(tmp_path, job, 1, f"127.0.0.1:{port}"), str(tmp_path))
    node1.start()
    counting = node1.store = _Counting(node1.store)
    try:
        yield node0, node1, counting
    finally:
        node1.close()
        node0.close()


def test_looks_at_the_verdict_and_the_live_nodes_cost_no_request(
    nodes: tuple[Cluster, Cluster, _Counting],
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
