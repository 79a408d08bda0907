"""The agent's step records: a dead rank 0's open batch, and a plain script's steps."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from stalwart.agent.processes._steps import StepRecords
from stalwart.agent.processes._workers import Worker, WorkerState
from stalwart.contract.board import OBSERVED, ProgressBoard
from stalwart.contract.shm_names import SlotNames, new_run_id
from stalwart.metrics import EventLog, read_events
from stalwart.metrics.goodput import account
from stalwart.metrics.journal import OPEN, StepJournal


def _agent(tmp_path: Path, strategy: str = "flash") -> Any:
    job = f"test-{uuid.uuid4().hex[:8]}"
    board = ProgressBoard(str(tmp_path / "board"), 2, create=True)
    w = Worker(0, 0, 0, pid=4242, state=WorkerState.RUNNING)
    return SimpleNamespace(
        cfg=SimpleNamespace(job=job, strategy=strategy),
        cluster=SimpleNamespace(names=SlotNames(job, new_run_id())),
        events=EventLog(str(tmp_path / "events.jsonl"), node=0),
        board=board,
        workers=SimpleNamespace(get={0: w}.get, slot=lambda w: board.read(w.slot)),
    )


def _records(agent: Any) -> StepRecords:
    return StepRecords(
        names=agent.cluster.names,
        events=agent.events,
        workers=agent.workers,
        generation=lambda: 0,
        strategy=agent.cfg.strategy,
    )


def _events(tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
    res = read_events(str(tmp_path / "events.jsonl"))
    assert not res.problems, res.problems
    return [(e.kind, e.fields) for e in res.events]


def _step(board: ProgressBoard, step: int, t: float) -> None:
    board.write(
        0,
        pid=4242,
        step=step,
        phase="step",
        generation=0,
        t_progress=t,
        t_alive=t,
        p99_s=0.0,
        mode=OBSERVED,
    )


def test_plain_script_steps_are_recorded_from_the_board(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    rec = _records(agent)
    _step(agent.board, 3, 1000.0)  # first seen at step 3: steps 1..3 took 3 s at 1 s/step
    rec.tick(0.0)
    for step in range(4, 11):
        _step(agent.board, step, 1000.0 + step - 3)
        rec.tick(0.0)
    rec.on_exit(4242)  # the process ended: its open batch is written
    events = _events(tmp_path)
    assert [f["route"] for k, f in events if k == "route"] == ["plain"]
    steps = [f for k, f in events if k == "steps"]
    assert steps[0]["first_step"] == 1 and steps[-1]["last_step"] == 10
    assert sum(f["count"] for f in steps) == 10
    assert abs(steps[0]["t_first_start"] - 997.0) < 1e-6
    g = account([e for e in read_events(str(tmp_path / "events.jsonl")).events], t_start=997.0)
    assert g.productive_steps == 10


def test_a_dead_rank0s_open_batch_is_written_once(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    rec = _records(agent)
    pid = 999_000 + os.getpid() % 1000
    batch = {
        "first_step": 11,
        "last_step": 35,
        "count": 25,
        "busy_s": 2.5,
        "t_first_start": 1000.0,
        "generation": 1,
    }
    j = StepJournal(agent.cluster.names.step_journal(pid))
    try:
        j.write(OPEN, batch, t_end=1003.0)
        rec.on_exit(pid)
        rec.on_exit(pid)  # seen twice: still written once, and the file is gone
        assert not os.path.exists(agent.cluster.names.step_journal(pid))
    finally:
        j.close()
    steps = [(k, f) for k, f in _events(tmp_path) if k == "steps"]
    assert [f for _, f in steps] == [batch]
    e = next(e for e in read_events(str(tmp_path / "events.jsonl")).events if e.kind == "steps")
    assert e.t == 1003.0 and e.rank == 0  # at the end of its last step, as rank 0's


def _plain_run_with_a_restart(tmp_path: Path, resumed: int) -> list[Any]:
    """A plain rank 0 steps 1..10 (1 s each), is killed, and its restart (another pid)
    writes ``resumed`` on the board (1 + the step its optimizer's state says it resumed
    after; 0: no step count in it) and steps 6 times. Returns the run's events."""
    agent = _agent(tmp_path)
    procs = {0: Worker(0, 0, 0, pid=4242, state=WorkerState.RUNNING)}
    agent.workers = SimpleNamespace(get=procs.get, slot=lambda w: agent.board.read(w.slot))
    generation = [0]
    rec = StepRecords(
        names=agent.cluster.names,
        events=agent.events,
        workers=agent.workers,
        generation=lambda: generation[0],
        strategy="flash",
    )
    for step in range(1, 11):
        _step(agent.board, step, 1000.0 + step)
        rec.tick(0.0)
    rec.on_exit(4242)
    agent.events.emit("fault_injected", t=1010.5, fault="kill", domain={"rank": 0}, spec="")
    agent.events.emit("recovery_begin", t=1010.6, strategy="restart", generation=1, cause="crash")
    generation[0] = 1
    procs[0] = Worker(0, 0, 0, pid=4343, state=WorkerState.RUNNING, t_spawn=1011.0)
    base = resumed - 1 if resumed else 0  # the script numbers its own steps from there
    for n in range(1, 7):
        agent.board.write(
            0,
            pid=4343,
            step=base + n,
            phase="step",
            generation=0,
            t_progress=1012.0 + n,
            t_alive=1012.0 + n,
            p99_s=0.0,
            mode=OBSERVED,
            resumed=resumed,
        )
        rec.tick(0.0)
    rec.on_exit(4343)
    return read_events(str(tmp_path / "events.jsonl")).events


def test_a_restarted_plain_script_resumes_at_its_optimizers_step(tmp_path: Path) -> None:
    """It resumed after step 7 (its own checkpoint): steps 8..10 were redone, no more."""
    events = _plain_run_with_a_restart(tmp_path, resumed=8)
    end = next(e for e in events if e.kind == "recovery_end")
    assert (end["restored_step"], end["steps_lost"], end["strategy"]) == (7, 3, "restart")
    steps = [e for e in events if e.kind == "steps" and e["generation"] == 1]
    assert steps[0]["first_step"] == 8 and steps[-1]["last_step"] == 13
    assert end.t == steps[0]["t_first_start"]  # the recovery ends where training resumes
    g = account(events, t_start=1000.0)
    assert (g.lost_steps, g.productive_steps, g.lost_unknown) == (3, 13, False)
    assert g.incidents[0].rto_s is not None
    assert abs(g.incidents[0].rto_s - (end.t - 1010.5)) < 1e-6


def test_a_restarted_plain_scripts_resume_step_unknown_is_said(tmp_path: Path) -> None:
    """No step count in its optimizer (SGD, or only the model saved): not 10 steps lost
    (counted from 1 again) nor 0, but unknown; its steps are numbered on from 10."""
    events = _plain_run_with_a_restart(tmp_path, resumed=0)
    end = next(e for e in events if e.kind == "recovery_end")
    assert (end["restored_step"], end["steps_lost"]) == (None, None)
    steps = [e for e in events if e.kind == "steps" and e["generation"] == 1]
    assert steps[0]["first_step"] == 11 and all(e["resume_unknown"] for e in steps)
    g = account(events, t_start=1000.0)
    assert g.lost_unknown and g.lost_steps == 0
    assert g.incidents[0].rto_s is not None
    from stalwart.metrics.report import RunReport, format_summary

    d = RunReport(str(tmp_path), events, g, False, []).to_dict()
    assert d["steps"]["lost"] is None
    text = format_summary(d)
    assert "lost steps unknown" in text and "ETTR <= " in text
