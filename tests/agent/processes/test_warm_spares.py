"""Warm spares (issue 28): under ``--strategy spare --standby`` a node parks a standby of
each of its own ranks, past the script's set-up (agent/processes/_standby.py), and a failed rank
resumes in it instead of in a spare that has only the imports done. In-process: which
ranks, the take-over, the refusals; the real job is in test_warm_spares_job.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from stalwart.agent.config import LaunchConfig
from stalwart.agent.processes._standby import Standbys
from stalwart.agent.processes._workers import Worker, WorkerState
from stalwart.contract.env import WorkerFields
from stalwart.contract.shm_names import SlotNames, new_run_id

RUN = new_run_id()


class _OneNode:
    """The ring of a one-node job (nobody to adopt) and LocalWorkers' side."""

    def __init__(self, nproc: int) -> None:
        self.names = SlotNames("warmtest", RUN)
        self.workers = {r: Worker(r, r, r, attached=True) for r in range(nproc)}
        self.sent: list[dict[str, Any]] = []
        self.standbys: Standbys | None = None
        self.step = 5

    def live_nodes(self) -> set[int]:
        return {0}

    def adopter(self, lost: int, live: set[int]) -> int | None:
        return None

    def ranks_of(self, node: int) -> list[int]:
        return list(self.workers)

    def ranks(self) -> list[int]:
        return list(self.workers)

    def last_step(self) -> int:
        return self.step

    def attached(self) -> bool:
        return True

    def free_slot(self) -> int:
        used = {w.slot for w in self.workers.values()}
        if self.standbys is not None:
            used |= self.standbys.used_slots()
        return min(set(range(len(used) + 1)) - used)

    def spawn_process(self, ident: str, slot: int, spec: dict[str, Any]) -> None:
        self.sent.append({"id": ident, "spec": spec})

    def adopt(self, rank: int, local: int, slot: int, *, pid: int = 0) -> Worker:
        raise AssertionError("a local rank is not adopted")

    def run_in(self, w: Worker, pid: int, slot: int) -> None:
        w.pid, w.slot, w.state = pid, slot, WorkerState.RUNNING


def _spec(w: Worker, extra: WorkerFields) -> dict[str, Any]:
    return {"rank": w.rank, "slot": w.slot, "env": dict(extra)}


def _node(*, own: bool, nproc: int = 2) -> tuple[_OneNode, Standbys]:
    node = _OneNode(nproc)
    sb = Standbys(
        node=0, nproc=nproc, names=node.names, ring=node, workers=node, spec=_spec, own=own
    )
    node.standbys = sb
    return node, sb


def test_a_spare_node_stands_by_for_its_own_ranks_on_free_slots() -> None:
    node, sb = _node(own=True)
    assert sb.targets() == {0, 1}
    sb.reconcile(1.0)
    assert sorted((m["spec"]["rank"], m["spec"]["slot"]) for m in node.sent) == [(0, 2), (1, 3)]
    _, flash = _node(own=False)
    assert flash.targets() == set()  # flash on one node: nobody to stand by for


def test_a_failed_rank_resumes_in_its_parked_standby() -> None:
    node, sb = _node(own=True)
    sb.reconcile(1.0)
    msg = next(m for m in node.sent if m["spec"]["rank"] == 1)
    pid = os.getpid()  # a live process stands in for the parked standby
    assert sb.on_spawned(msg["id"], pid)
    go = msg["spec"]["env"]["standby"]
    failed = node.workers[1]
    failed.pid, failed.state = 4_000_000, WorkerState.GONE  # it died
    try:
        assert sb.take(failed)
        assert (failed.pid, failed.slot, failed.state) == (pid, 3, WorkerState.RUNNING)
        assert os.path.exists(go) and sb.activated == 1  # let run: its recovery begins
        assert 1 not in sb.by_rank and not sb.take(failed)  # used once
        assert not sb.on_exit(pid)  # its exit is the worker's now, not a standby's
        sb.reconcile(3.0)  # none while the recovery runs (its set-up would take the cores)
        assert len([m for m in node.sent if m["spec"]["rank"] == 1]) == 1
        node.step = 6  # the job passed the step it failed at
        sb.reconcile(4.0)  # a new one is parked for rank 1, on the freed slot
        again = [m for m in node.sent if m["spec"]["rank"] == 1]
        assert len(again) == 2 and again[-1]["spec"]["slot"] == 1
    finally:
        if os.path.exists(go):
            os.unlink(go)


def test_no_take_without_a_live_standby_or_outside_spare() -> None:
    node, sb = _node(own=True)
    sb.reconcile(1.0)
    assert not sb.take(node.workers[0])  # forked, no pid yet: a spare takes it
    for m in node.sent:
        sb.on_spawned(m["id"], 4_000_000 + m["spec"]["rank"])  # no such processes
    assert not sb.take(node.workers[0])
    _, flash = _node(own=False)
    assert not flash.take(node.workers[0])


def test_config_takes_standby_on_one_node_under_spare_only(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = LaunchConfig(str(script), standby=True, strategy="spare", spares=1)
    assert cfg.standby and cfg.nnodes == 1
    with pytest.raises(ValueError, match="--strategy spare"):
        LaunchConfig(str(script), standby=True, strategy="flash")
