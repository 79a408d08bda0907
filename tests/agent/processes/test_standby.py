"""Standby workers (agent/processes/_standby.py, runtime/state/_standby.py), in-process:
which ranks a node stands by for, starting and stopping them as the ring changes, claiming one for a
lost rank and activating it; the worker's park; the config's refusals. The real thing
(a node lost, its ranks resumed in standbys, the result bit-identical) is in
test_node_replicas.py."""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from stalwart.agent.cluster._cluster import ring_successor
from stalwart.agent.config import LaunchConfig
from stalwart.agent.processes._standby import Standbys
from stalwart.agent.processes._workers import Worker, WorkerState
from stalwart.contract.env import WorkerFields
from stalwart.contract.shm_names import SlotNames, new_run_id
from stalwart.errors import ConfigError
from stalwart.runtime.state._standby import Preload, park

RUN = new_run_id()


@dataclass
class _Cluster:
    live: set[int]
    ranks: dict[int, list[int]]
    names: SlotNames = field(default_factory=lambda: SlotNames("sbtest", RUN))

    def live_nodes(self) -> set[int]:
        return set(self.live)

    def adopter(self, lost: int, live: set[int]) -> int | None:
        return ring_successor(lost, live)

    def ranks_of(self, node: int) -> list[int]:
        return self.ranks[node]


class _FakeAgent:
    """What Standbys uses: the ring (cluster) and LocalWorkers' side, and nothing else."""

    def __init__(self, node: int, nnodes: int, nproc: int) -> None:
        self.node, self.nproc = node, nproc
        ranks = {n: list(range(n * nproc, (n + 1) * nproc)) for n in range(nnodes)}
        self.cluster = _Cluster(set(range(nnodes)), ranks)
        self.workers = {
            r: Worker(r, r % nproc, i, attached=True) for i, r in enumerate(ranks[node])
        }
        self.sent: list[dict[str, Any]] = []
        self.standbys: Standbys | None = None
        self.step = 5
        self.is_attached = True  # the workers run the stalwart runtime

    # LocalWorkers' side
    def ranks(self) -> list[int]:
        return list(self.workers)

    def last_step(self) -> int:
        return self.step

    def attached(self) -> bool:
        return self.is_attached

    def free_slot(self) -> int:
        used = {w.slot for w in self.workers.values()}
        if self.standbys is not None:
            used |= self.standbys.used_slots()
        return min(set(range(len(used) + 1)) - used)

    def spawn_process(self, ident: str, slot: int, spec: dict[str, Any]) -> None:
        self.sent.append({"op": "spawn", "id": ident, "spec": spec})

    def adopt(self, rank: int, local: int, slot: int, *, pid: int = 0) -> Worker:
        w = Worker(rank, local, slot, attached=True)
        if pid:
            w.pid, w.state = pid, WorkerState.RUNNING
        self.workers[rank] = w
        return w


def _spec(w: Worker, extra: WorkerFields) -> dict[str, Any]:
    return {"rank": w.rank, "slot": w.slot, "env": dict(extra)}


def _standbys(node: int, nnodes: int = 3, nproc: int = 2) -> tuple[_FakeAgent, Standbys]:
    agent = _FakeAgent(node, nnodes, nproc)
    sb = Standbys(
        node=node,
        nproc=nproc,
        names=agent.cluster.names,
        ring=agent.cluster,
        workers=agent,
        spec=_spec,
    )
    agent.standbys = sb
    return agent, sb


def test_a_node_stands_by_for_the_ranks_of_its_ring_predecessor() -> None:
    _, sb = _standbys(node=1)
    assert sb.targets() == {0, 1}  # node 0's successor is node 1
    _, sb = _standbys(node=0)
    assert sb.targets() == {4, 5}  # the ring wraps: node 2 -> node 0


def test_standbys_start_after_the_first_step_on_free_slots_and_follow_the_ring() -> None:
    agent, sb = _standbys(node=1)
    agent.step = 0
    sb.reconcile(0.0)
    assert agent.sent == []  # the job's own start is not slowed
    agent.step = 3
    sb.reconcile(1.0)
    spawned = [m for m in agent.sent if m["op"] == "spawn"]
    assert sorted(m["spec"]["rank"] for m in spawned) == [0, 1]
    assert sorted(m["spec"]["slot"] for m in spawned) == [2, 3]  # workers hold 0 and 1
    for m in spawned:
        go = m["spec"]["env"]["standby"]
        assert go.startswith(f"/dev/shm/stalwart-sbtest-{RUN}-standby-r") and not os.path.exists(go)
        assert sb.on_spawned(m["id"], 1_000_000 + m["spec"]["rank"])
    sb.reconcile(1.5)  # within the second: nothing read, nothing started
    assert len(agent.sent) == 2
    # node 0 leaves the ring: node 1 now stands by for node 2's ranks, 0 and 1 are stale
    agent.cluster.live = {1, 2}
    sb.reconcile(3.0)
    assert sorted(sb.by_rank) == [4, 5]
    assert sorted(s.slot for s in sb.by_rank.values()) == [2, 3]  # the stale ones' slots
    assert not sb.on_exit(1_000_000)  # the stopped standby's exit is not a standby's


def test_a_plain_script_gets_no_standbys() -> None:
    """A script without stalwart.init() never parks: a standby would train as a second
    copy of its rank."""
    agent, sb = _standbys(node=1)
    agent.is_attached = False
    sb.reconcile(1.0)
    assert agent.sent == [] and not sb.by_rank


def test_a_claimed_standby_becomes_the_worker_and_is_activated_by_its_file() -> None:
    agent, sb = _standbys(node=1)
    sb.reconcile(1.0)
    msg = next(m for m in agent.sent if m["spec"]["rank"] == 0)
    pid = os.getpid()  # a live process stands in for the standby
    sb.on_spawned(msg["id"], pid)
    go = msg["spec"]["env"]["standby"]
    try:
        assert sb.claim(1) is None  # rank 1's standby has no pid yet: start one afresh
        w = sb.claim(0)
        assert w is not None and (w.rank, w.pid, w.state) == (0, pid, WorkerState.RUNNING)
        assert w.slot == msg["spec"]["slot"] and 0 not in sb.by_rank
        assert not os.path.exists(go)
        assert sb.activate(w) and os.path.exists(go) and sb.activated == 1
        assert not sb.activate(w)  # once
    finally:
        if os.path.exists(go):
            os.unlink(go)


def test_a_dead_standby_is_not_claimed_and_is_replaced() -> None:
    agent, sb = _standbys(node=1)
    sb.reconcile(1.0)
    for m in agent.sent:
        sb.on_spawned(m["id"], 4_000_000 + m["spec"]["rank"])  # no such processes
    assert sb.claim(0) is None
    assert sb.on_exit(4_000_001) and 1 not in sb.by_rank
    sb.reconcile(2.0)
    assert sorted(m["spec"]["rank"] for m in agent.sent) == [0, 1, 1]


def test_park_waits_for_its_file_and_removes_it(tmp_path: Path) -> None:
    go = tmp_path / "go"
    phases: list[str] = []
    preload = Preload(SlotNames(f"test-park-{uuid.uuid4().hex[:8]}", new_run_id()), 0)
    parked: list[float] = []

    def wait() -> None:
        parked.append(park(str(go), preload, {}, phases.append, poll_s=0.002))

    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 30
    while phases != ["standby"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert phases == ["standby"]
    waiter.join(0.2)
    assert waiter.is_alive() and not parked  # parked: it cannot return without its file
    go.write_text("{}")
    waiter.join(30)
    assert parked and parked[0] > 0 and not go.exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "restart", "nnodes": 2}, "--standby needs --strategy flash or spare"),
        ({"strategy": "elastic", "nnodes": 2}, "--standby needs --strategy flash or spare"),
        ({"strategy": "flash", "nnodes": 1}, "--nnodes >= 2"),
    ],
)
def test_config_refuses_standby_where_it_cannot_work(
    kwargs: dict[str, Any], match: str, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    extra = {"rdzv_endpoint": "127.0.0.1:1"} if kwargs["nnodes"] > 1 else {}
    with pytest.raises(ConfigError, match=match):
        LaunchConfig(str(script), standby=True, **kwargs, **extra)
