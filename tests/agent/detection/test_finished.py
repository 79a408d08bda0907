"""A job whose ranks have begun to exit cleanly is finishing, in-process: a rank stuck
after its peer exited 0 is ended and counted as finished (never a restart), and a rank
that fails then ends the job under the restart route too (agent/detection/_finished.py)."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _load import scaled

from stalwart.agent._outcome import RunFailed
from stalwart.agent.cluster._generation import JobGeneration
from stalwart.agent.detection._detectors import HangDetector, HangWatch
from stalwart.agent.detection._finished import ExitWatch, hung_at_exit
from stalwart.agent.detection.hang import Activity, HangConfig
from stalwart.agent.detection.incidents import WorkerExited
from stalwart.agent.detection.verdict import Failure
from stalwart.agent.processes._proc import read_cpu
from stalwart.agent.processes._workers import LocalWorkers, WorkerState
from stalwart.agent.strategies._restart import RestartAll
from stalwart.agent.strategies.policy import RecoveryParts
from stalwart.chaos import FaultLedger
from stalwart.contract.board import OBSERVED, ProgressBoard, Slot
from stalwart.contract.env import WorkerEnv
from stalwart.errors import ConfigError

from .._fakes import FakeEvents, FakeLaunch, FakeZygote, coordinator


def _slot(pid: int, t_progress: float) -> Slot:
    return Slot(pid, 48, "step", 0, t_progress, t_progress, 0.01, False)


def test_after_a_clean_exit_an_idle_rank_is_ended_once_its_grace_passed() -> None:
    slots = {0: _slot(10, 100.0)}
    idle = {0: Activity("S", t_busy=100.0)}
    # the peer finished at 101: the grace counts from then, not from the last step
    assert hung_at_exit(slots, idle, 105.0, done=1, since=101.0, grace_s=5.0) is None
    hang = hung_at_exit(slots, idle, 106.5, done=1, since=101.0, grace_s=5.0)
    assert hang is not None and hang.ranks == [0] and hang.done == 1
    line = hang.line(0, 48)
    assert line.startswith("rank 0 hung at exit") and "not restarted" in line
    # a rank that computes alone (a final save or eval) is never ended
    busy = {0: Activity("R", t_busy=106.4)}
    assert hung_at_exit(slots, busy, 106.5, done=1, since=101.0, grace_s=5.0) is None
    # a stopped one is: nobody will ever wait for it
    stopped = {0: Activity("T", t_busy=100.0, t_stopped=102.0)}
    assert hung_at_exit(slots, stopped, 106.5, done=1, since=101.0, grace_s=5.0) is not None


def test_exit_grace_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--exit-grace"):
        HangConfig(exit_grace_s=0.0)


def _board(tmp_path: Path) -> ProgressBoard:
    return ProgressBoard(str(tmp_path / f"board-{uuid.uuid4().hex[:6]}"), 4, create=True)


def test_a_rank_stuck_after_its_peer_exited_0_is_ended_not_restarted(tmp_path: Path) -> None:
    # the DDP tutorial under the restart route: rank 1 exited 0, rank 0 printed its result
    # and then sat in its teardown (no CPU). It used to be "no CPU progress on any rank of
    # the job (a deadlock)": killed, every worker restarted, the script resumed from its
    # own snapshot and trained its last epochs again (rc 0, another result)
    zygote = FakeZygote()
    workers = LocalWorkers([0, 1], _board(tmp_path), zygote)
    config = HangConfig(idle_s=2.0, exit_grace_s=5.0)
    events, said = FakeEvents(), []
    ended = subprocess.Popen(["sleep", "600"])  # rank 0's process: alive, using no CPU
    try:
        _asleep(ended.pid)
        for rank, pid in ((0, ended.pid), (1, ended.pid + 100_000)):
            workers.spawn(workers[rank], generation=0)
            workers.on_message({"op": "spawned", "id": f"rank-{rank}", "pid": pid})
            workers.board.write(rank, pid=pid, step=48, phase="step", generation=0,
                                t_progress=1000.0, t_alive=1000.0, p99_s=0.01,
                                mode=OBSERVED)  # fmt: skip
        workers.on_message({"op": "exit", "pid": ended.pid + 100_000, "rc": 0, "t": 0})
        assert workers[1].state is WorkerState.DONE
        detector = HangDetector(
            config=config, node=0, whole_job=True, workers=workers, watch=HangWatch(config),
            ledger=FaultLedger(str(tmp_path)), events=events, say=said.append,
            exits=ExitWatch(lambda: workers.finished_peer(-1), config.exit_grace_s),
        )  # fmt: skip
        t0 = 1001.0
        assert detector.check(t0, generation=0, slowed=frozenset()) == []
        # past --hang-idle (the old deadlock verdict) but within the grace: nothing
        assert detector.check(t0 + 3.0, generation=0, slowed=frozenset()) == []
        assert ended.poll() is None
        # past the grace: no incident (nothing to recover), rank 0 ended, one line
        assert detector.check(t0 + 6.0, generation=0, slowed=frozenset()) == []
        assert ended.wait(timeout=scaled(60)) == -9
        (line,) = said
        assert line.startswith("rank 0 hung at exit") and "rank 1 finished the job" in line
        assert events.of("note") == [{"message": line}]
        assert events.of("fault_detected") == []
        # its exit (killed) is a finish: no failure to recover, the job is done
        assert workers.on_message({"op": "exit", "pid": ended.pid, "rc": -9, "t": 0}) is None
        assert workers[0].state is WorkerState.DONE and workers.finished()
    finally:
        ended.kill()
        ended.wait()


def _asleep(pid: int) -> None:
    """Wait until ``pid`` sleeps (state S): a process just started runs (R) a while."""
    deadline = time.monotonic() + 60
    while (seen := read_cpu(pid)) is None or seen[0] != "S":
        assert time.monotonic() < deadline, f"process {pid} never slept: {seen}"
        time.sleep(0.05)


def test_a_rank_that_never_passed_the_finish_barrier_is_not_counted_finished() -> None:
    # --strategy async, two groups of one (the 365 s rc 0 run of test_async.py without
    # part 0's output): group 0's rank gave up on the finish barrier (its peer was away
    # for the hang ceiling) and waits in its recovery; group 1's rank came back, passed
    # the barrier on group 0's stale arrival and said ``done``. Group 0's rank is idle
    # after that, but it never finished: ending it as "hung at exit" counted it finished
    # and the job ended ok without its result
    slots = {
        0: Slot(10, 7, "step", 0, 100.0, 100.0, 0.01, True),  # the runtime's, at step 7
        1: Slot(11, 10, "done", 0, 101.0, 101.0, 0.01, True),  # passed the barrier
    }
    idle = {0: Activity("S", t_busy=100.0), 1: Activity("S", t_busy=101.0)}
    watch = ExitWatch(lambda: 1, grace_s=5.0)
    assert watch.check(slots, idle, 101.0) == (True, None)
    finishing, hang = watch.check(slots, idle, 106.5)
    assert finishing and hang is not None
    assert hang.ranks == [1]  # ended as finished: only the rank that passed the barrier
    assert hang.unfinished == [0]  # a hang: its strategy recovers it or the job fails
    # a restarted process of a runtime rank (its slot not written yet) did not finish either
    starting = {0: Slot(12, 0, "starting", 0, 100.0, 0.0, 0.0, False)}
    hang = hung_at_exit(starting, idle, 106.5, done=1, since=101.0, grace_s=5.0, runtime={0})
    assert hang is not None and hang.ranks == [] and hang.unfinished == [0]


def test_an_unfinished_rank_idle_after_a_peer_finished_is_a_hang_not_a_finish(
    tmp_path: Path,
) -> None:
    # the agent's side: group 1's rank exited 0; group 0's rank (the runtime's, stuck at
    # step 7) is killed as a hang once the grace passed, and its exit is a failure to
    # recover (under async its group starts again and rejoins), never a finish
    zygote = FakeZygote()
    workers = LocalWorkers([0, 1], _board(tmp_path), zygote)
    config = HangConfig(idle_s=2.0, exit_grace_s=5.0)
    events, said = FakeEvents(), []
    stuck = subprocess.Popen(["sleep", "600"])  # rank 0's process: alive, using no CPU
    try:
        _asleep(stuck.pid)
        for rank, pid, step in ((0, stuck.pid, 7), (1, stuck.pid + 100_000, 10)):
            workers.spawn(workers[rank], generation=0)
            workers.on_message({"op": "spawned", "id": f"rank-{rank}", "pid": pid})
            workers.board.write(rank, pid=pid, step=step, phase="step", generation=0,
                                t_progress=1000.0, t_alive=1000.0, p99_s=0.01)  # fmt: skip
        workers.on_message({"op": "exit", "pid": stuck.pid + 100_000, "rc": 0, "t": 0})
        watch = HangWatch(config)
        detector = HangDetector(
            config=config, node=0, whole_job=True, workers=workers, watch=watch,
            ledger=FaultLedger(str(tmp_path)), events=events, say=said.append,
            exits=ExitWatch(lambda: workers.finished_peer(-1), config.exit_grace_s),
        )  # fmt: skip
        t0 = 1001.0
        assert detector.check(t0, generation=0, slowed=frozenset()) == []
        assert detector.check(t0 + 3.0, generation=0, slowed=frozenset()) == []
        (hung,) = detector.check(t0 + 6.0, generation=0, slowed=frozenset())
        assert (hung.rank, hung.pid, hung.collateral) == (0, stuck.pid, False)
        assert "never passed the finish barrier" in hung.how and "rank 1" in hung.how
        assert not any(line.startswith("rank 0 hung at exit") for line in said)
        (fault,) = events.of("fault_detected")
        assert fault["fault"] == "hang" and fault["domain"] == {"rank": 0, "node": 0}
        detector.isolate(hung)
        assert stuck.wait(timeout=scaled(60)) == -9
        ended = workers.on_message({"op": "exit", "pid": stuck.pid, "rc": -9, "t": 0})
        assert ended is not None and (ended.rank, ended.cause) == (0, "hang")
        assert workers[0].state is WorkerState.DEAD and not workers.finished()
    finally:
        stuck.kill()
        stuck.wait()


def _restart_parts(tmp_path: Path) -> RecoveryParts:
    cfg: Any = SimpleNamespace(job="t", node_rank=0, nproc_per_node=2, max_restarts=3,
                               world_size=2, runtime=WorkerEnv())  # fmt: skip
    coord, launch, events = coordinator(), FakeLaunch(), FakeEvents()
    workers = LocalWorkers([0, 1], _board(tmp_path), FakeZygote())
    gen = JobGeneration(coord, launch, events, world_size=2)
    parts = RecoveryParts(cfg, workers, gen, coord, launch, events,  # type: ignore[arg-type]
                          FaultLedger(str(tmp_path)), None, lambda _: None)  # fmt: skip
    workers.wire(lambda w, extra: {"rank": w.rank}, parts.joined, assign_spares=False)
    for w in workers:
        parts.spawn(w)
        workers.on_message({"op": "spawned", "id": f"rank-{w.rank}", "pid": 2000 + w.rank})
    return parts


def test_the_restart_route_never_restarts_a_job_a_rank_finished(tmp_path: Path) -> None:
    parts = _restart_parts(tmp_path)
    policy = RestartAll(parts)
    parts.workers.on_message({"op": "exit", "pid": 2001, "rc": 0, "t": 0.0})  # rank 1 done
    assert parts.launch.published("finished") == {"rank": 1, "node": 0}
    parts.workers.on_message({"op": "exit", "pid": 2000, "rc": 1, "t": 0.0})
    failure = Failure(0, "after step 48", "RuntimeError: teardown", "crash")
    with pytest.raises(RunFailed, match=r"rank 0 failed after step 48 .* when rank 1 had"):
        policy.on_incident(WorkerExited(0, 2000, 1, "crash", failure, None))
    assert parts.generation.restarts == 0
