"""LocalWorkers, in-process with a fake zygote and a real progress board: the worker state
machine (each transition through one method), exits as typed events, spares, watchers."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from stalwart.agent.processes._workers import LocalWorkers, ProcessExit, Worker, WorkerState
from stalwart.contract.board import ProgressBoard

from .._fakes import FakeZygote


def _workers(tmp_path: Path, ranks: list[int] | None = None) -> tuple[LocalWorkers, FakeZygote]:
    board = ProgressBoard(str(tmp_path / f"board-{uuid.uuid4().hex[:6]}"), 8, create=True)
    zygote = FakeZygote()
    workers = LocalWorkers(ranks or [0, 1], board, zygote)
    joined: list[int] = []
    workers.wire(lambda w, extra: {"rank": w.rank, **extra}, lambda w: joined.append(w.rank),
                 assign_spares=False)  # fmt: skip
    return workers, zygote


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def _spawned(workers: LocalWorkers, zygote: FakeZygote, rank: int, pid: int) -> None:
    ident = next(m["id"] for m in reversed(zygote.sent) if m.get("id") == f"rank-{rank}")
    assert workers.on_message({"op": "spawned", "id": ident, "pid": pid}) is None


def test_a_worker_starts_runs_and_finishes(tmp_path: Path) -> None:
    workers, zygote = _workers(tmp_path)
    w = workers[0]
    workers.spawn(w, generation=0)
    assert w.state is WorkerState.STARTING and zygote.sent[-1]["op"] == "spawn"
    _spawned(workers, zygote, 0, 100)
    assert (w.state, w.pid) == (WorkerState.RUNNING, 100)
    assert workers.on_message({"op": "exit", "pid": 100, "rc": 0, "t": 1.0}) is None
    assert w.state is WorkerState.DONE and not workers.finished()  # rank 1 never ran
    workers.retire(workers[1])
    assert workers.finished()


def test_a_failed_exit_is_a_typed_event_once(tmp_path: Path) -> None:
    workers, zygote = _workers(tmp_path)
    workers.spawn(workers[1], generation=0)
    _spawned(workers, zygote, 1, 101)
    zygote.queue = [{"op": "exit", "pid": 101, "rc": -9, "t": 5.0}] * 2
    assert workers.poll(0.0) == [ProcessExit(1, 101, -9, 5.0, "")]  # the second is stale
    assert workers[1].state is WorkerState.DEAD


def test_exits_the_agent_caused_for_a_stop_are_not_failures(
    tmp_path: Path, kills: list[tuple[int, int]]
) -> None:
    workers, zygote = _workers(tmp_path)
    for rank, pid in ((0, 200), (1, 201)):
        workers.spawn(workers[rank], generation=0)
        _spawned(workers, zygote, rank, pid)
    zygote.queue = [{"op": "exit", "pid": p, "rc": -9, "t": 1.0} for p in (200, 201)]
    workers.stop_all("restart", timeout=1.0)
    assert sorted(pid for pid, _ in kills) == [200, 201]
    assert all(w.state is WorkerState.DEAD and w.cause == "restart" for w in workers)


def test_a_hang_kill_comes_back_with_its_cause(
    tmp_path: Path, kills: list[tuple[int, int]]
) -> None:
    workers, zygote = _workers(tmp_path)
    workers.spawn(workers[0], generation=0)
    _spawned(workers, zygote, 0, 300)
    workers.kill(workers[0], "hang")
    (exit_,) = [workers.on_message({"op": "exit", "pid": 300, "rc": -9, "t": 2.0})]
    assert exit_ == ProcessExit(0, 300, -9, 2.0, "hang")
    assert workers.judged() == {}  # a dead worker is not judged
    workers.spawn(workers[0], generation=1)
    assert workers[0].cause == "" and workers[0].state is WorkerState.STARTING


def test_under_spare_a_replacement_takes_a_preforked_spare(tmp_path: Path) -> None:
    workers, zygote = _workers(tmp_path)
    workers.wire(lambda w, extra: {"rank": w.rank}, lambda w: None, assign_spares=True)
    workers.prefork()
    workers.on_message({"op": "spawned", "id": "spare-pending", "pid": 777})
    w = workers[0]
    workers.spawn(w, generation=0)  # the first start forks
    assert zygote.sent[-1]["op"] == "spawn"
    workers.spawn(w, generation=1)
    assign, prefork = zygote.sent[-2:]
    assert assign == {"op": "assign", "pid": 777, "spec": {"rank": 0}}
    assert prefork["op"] == "prefork"  # the spare is replaced
    assert (w.pid, w.state) == (777, WorkerState.RUNNING)


class _Watcher:
    def __init__(self) -> None:
        self.mine: dict[str, int] = {}

    def on_spawned(self, ident: str, pid: int) -> bool:
        if ident.startswith("standby-"):
            self.mine[ident] = pid
            return True
        return False

    def on_exit(self, pid: int) -> bool:
        return pid in self.mine.values()

    def used_slots(self) -> set[int]:
        return {2}

    def pids(self) -> list[int]:
        return list(self.mine.values())


def test_watched_processes_are_not_workers_and_hold_their_slots(tmp_path: Path) -> None:
    workers, _ = _workers(tmp_path)
    seen: list[int] = []
    workers.watch(_Watcher())
    workers.on_any_exit(seen.append)
    workers.spawn_process("standby-4-ab", 2, {"rank": 4})
    workers.on_message({"op": "spawned", "id": "standby-4-ab", "pid": 900})
    assert workers.on_message({"op": "exit", "pid": 900, "rc": -9, "t": 1.0}) is None
    assert seen == [900] and all(w.pid != 900 for w in workers)
    assert workers.free_slot() == 3  # 0, 1: workers; 2: the standby
    w = workers.adopt(5, 1, workers.free_slot())
    assert w.slot == 3 and 5 in workers and w.state is WorkerState.STARTING


def test_a_claimed_standby_enters_running_and_attached(tmp_path: Path) -> None:
    workers, _ = _workers(tmp_path)
    w: Worker = workers.adopt(4, 0, 2, pid=4321)
    assert (w.state, w.pid, w.attached) == (WorkerState.RUNNING, 4321, True)
    assert workers.running() == [w]


def test_the_board_teaches_attached_and_recovered(tmp_path: Path) -> None:
    workers, zygote = _workers(tmp_path)
    workers.spawn(workers[0], generation=0)
    _spawned(workers, zygote, 0, os.getpid())
    board: Any = workers.board
    board.write(0, pid=os.getpid(), step=7, phase="recovering", generation=1, t_progress=1.0,
                t_alive=1.0, p99_s=0.0)  # fmt: skip
    assert not workers.attached()
    assert 0 in workers.judged() and workers[0].attached
    assert not workers.recovered(generation=1)
    board.write(0, pid=os.getpid(), step=8, phase="step", generation=1, t_progress=2.0,
                t_alive=2.0, p99_s=0.0)  # fmt: skip
    assert workers.recovered(generation=1) and workers.last_step() == 8
