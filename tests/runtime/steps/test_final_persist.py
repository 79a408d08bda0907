"""The loop's end waits for the final persist committed and logged, not only written.

A persist's future resolves once the persister replied and the engine committed the
step (checkpoint/manager.py, on the persister's reader thread, a daemon); the
``persist_end`` event runs in its done callback, on the same thread. A future's waiters
wake before its callbacks run, so a session that waited on the future exited while the
outcome was being logged (before the commit moved into the engine: mid-commit, the final
step's manifest left pending), no ``persist_end``, and the run ``ok`` with an older
newest checkpoint (tests/hosts/test_partition.py).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from stalwart.checkpoint import CommitOutcome, CommitPlan, PersistResult
from stalwart.errors import CheckpointError
from stalwart.runtime.steps._accounting import StepAccounting

_FINAL = 600
# how long the outcome's event stays in flight unless the loop's end returns first: before
# the fix it returned at once; after, it cannot return before the event, which then
# waits all of this (never part of a pass/fail threshold)
_IN_FLIGHT_S = 1.0


class _Events:
    """The outcome's event is slow to log (a full disk, a busy core)."""

    def __init__(self, loop_ended: threading.Event) -> None:
        self.loop_ended = loop_ended
        self.logged: list[tuple[str, dict[str, Any]]] = []
        self.late: list[str] = []  # events logged after the loop had ended

    def emit(self, kind: str, **fields: Any) -> None:
        if kind == "persist_end":
            self.loop_ended.wait(timeout=_IN_FLIGHT_S)
            if self.loop_ended.is_set():
                self.late.append(kind)
        self.logged.append((kind, fields))


class _Checkpoints:
    """The persist's write is answered by the test, then committed as the plan says."""

    def __init__(self, fail: bool = False) -> None:
        self.write: Future[PersistResult] = Future()
        self.fail = fail
        self.plans: list[CommitPlan] = []

    def snapshot(self, state: Any, step: int, *, blocking: bool, on_done: Any) -> None:
        return None

    def persist(self, *, commit: CommitPlan, copy_of: int | None) -> Future[PersistResult]:
        self.plans.append(commit)
        return self.write

    def outcome(self, step: int) -> CommitOutcome:
        if self.fail:
            return CommitOutcome(step, error=CheckpointError("the storage is read-only\nmore"))
        return CommitOutcome(step, result=SimpleNamespace(manifest=None))  # type: ignore[arg-type]


def _final_persist(fail: bool) -> tuple[_Checkpoints, _Events]:
    """Persist the final step, answer its write and commit from another thread (the
    persister's reply, committed by the engine), and end the loop as Session._finish
    does."""
    loop_ended = threading.Event()
    ckpt = _Checkpoints(fail)
    env: Any = SimpleNamespace(
        persist_every=100, snapshot_every=100, snapshot_budget=0.02, job="j", replica_group=None
    )
    position: Any = SimpleNamespace(rank=0, generation=3, world_size=1)
    tracked: Any = SimpleNamespace(
        state={},
        checkpoints=ckpt,
        opened=False,
        part=None,
        replicated=False,
        sharded=False,
        copy_key=None,
    )
    events = _Events(loop_ended)
    coord: Any = SimpleNamespace()  # under an agent: this rank commits, fenced
    acct = StepAccounting(env, position, tracked, events, coord, None)  # type: ignore[arg-type]
    acct.maybe_snapshot(_FINAL, final=True)
    assert [k for k, _ in events.logged] == ["persist_begin"]

    written = PersistResult(_FINAL, 10, 10, 0.01, committed=False, raw={})
    written.commit = ckpt.outcome(_FINAL)
    reader = threading.Thread(target=ckpt.write.set_result, args=(written,))  # the reply
    reader.start()
    acct.wait_persist()  # Session._finish: then the finish barrier, and the exit
    loop_ended.set()
    reader.join()
    return ckpt, events


def test_the_loops_end_waits_for_the_final_persist_to_be_committed_and_logged() -> None:
    ckpt, events = _final_persist(fail=False)
    assert [p.generation for p in ckpt.plans] == [3]  # fenced by the generation it trained in
    assert events.late == [], "the loop ended while the final persist's outcome was logged"
    ends = [f for k, f in events.logged if k == "persist_end"]
    assert [(f["step"], f["ok"]) for f in ends] == [(_FINAL, True)]


def test_a_final_persist_that_did_not_commit_is_said_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        _, events = _final_persist(fail=True)
    assert events.late == []
    ends = [f for k, f in events.logged if k == "persist_end"]
    assert [(f["ok"], f["error"]) for f in ends] == [(False, "the storage is read-only")]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == [
        "rank 0: the persist of step 600 did not commit (the storage is read-only); "
        "the newest checkpoint is older"
    ]
