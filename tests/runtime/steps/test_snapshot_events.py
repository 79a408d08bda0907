"""Every snapshot's event is logged when the snapshot completes, the last one included."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stalwart.checkpoint import CheckpointConfig, CheckpointManager
from stalwart.runtime.steps._accounting import StepAccounting


class _Events:
    def __init__(self) -> None:
        self.logged: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.logged.append((kind, fields))

    def snapshots(self) -> list[int]:
        return [int(f["step"]) for kind, f in self.logged if kind == "snapshot"]


@pytest.fixture
def loop(tmp_path: Any, shm_namespace: str) -> Iterator[tuple[Any, StepAccounting]]:
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = CheckpointManager(CheckpointConfig(root=str(tmp_path), namespace=shm_namespace))
    ckpt.snapshots.guard(opt)  # as Session.track does: opt.step waits for the copy
    env: Any = SimpleNamespace(persist_every=0, snapshot_every=1, snapshot_budget=0.02, job="j")
    position: Any = SimpleNamespace(rank=0, generation=0, world_size=1)
    state = {"model": model, "optimizer": opt}
    tracked: Any = SimpleNamespace(
        state=state, checkpoints=ckpt, opened=True, part=None, replicated=True
    )
    sess: Any = SimpleNamespace(_state=state, events=_Events())
    try:
        yield sess, StepAccounting(env, position, tracked, sess.events, None, None)
    finally:
        ckpt.close()


def _step(sess: Any) -> None:
    model, opt = sess._state["model"], sess._state["optimizer"]
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()


def test_a_snapshot_is_logged_once_the_step_after_it_waited_for_it(
    loop: tuple[Any, StepAccounting],
) -> None:
    sess, acct = loop
    _step(sess)
    acct.maybe_snapshot(1)
    _step(sess)  # the optimizer's pre-step hook waits for snapshot 1's background copy
    assert sess.events.snapshots() == [1]  # not only at the next snapshot
    assert acct.stalls and acct.stalls[-1] >= 0.0


def test_the_last_snapshot_is_logged_at_the_end_of_the_loop(
    loop: tuple[Any, StepAccounting],
) -> None:
    sess, acct = loop
    total = 5
    for step in range(1, total + 1):
        _step(sess)
        acct.maybe_snapshot(step, final=step == total)
    acct.wait_persist()  # what Session._finish runs before the finish barrier
    assert sess.events.snapshots() == [1, 2, 3, 4, 5]
    stalls = [f["stall_s"] for kind, f in sess.events.logged if kind == "snapshot"]
    assert all(s >= 0.0 for s in stalls) and len(acct.stalls) == total


def test_a_loop_left_early_still_logs_its_last_snapshot(loop: tuple[Any, StepAccounting]) -> None:
    sess, acct = loop
    for step in (1, 2):
        _step(sess)
        acct.maybe_snapshot(step)
    acct.close()  # Session.close: the loop was left by an exception
    assert sess.events.snapshots() == [1, 2]


def test_a_snapshot_that_does_not_fit_is_skipped_with_one_event_and_training_goes_on(
    loop: tuple[Any, StepAccounting], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stalwart.checkpoint import _shm

    sess, acct = loop
    _step(sess)
    acct.maybe_snapshot(1)
    real = _shm.os.statvfs

    def full(path: Any) -> Any:
        st = real(path)
        return _shm.os.statvfs_result((st.f_bsize, st.f_frsize, 0, 0, 0, 0, 0, 0, 0, 255))

    monkeypatch.setattr(_shm.os, "statvfs", full)
    for step in (2, 3):  # slot 1 must be created: refused, twice, one event
        _step(sess)
        acct.maybe_snapshot(step)
    monkeypatch.setattr(_shm.os, "statvfs", real)
    _step(sess)
    acct.maybe_snapshot(4)
    _step(sess)
    probes = [(f["ok"], f["domain"]["rank"]) for kind, f in sess.events.logged if kind == "probe"]
    assert probes == [(False, 0), (True, 0)]
    assert sess.events.snapshots() == [1, 4]
    refused = next(f for kind, f in sess.events.logged if kind == "probe")
    assert "refused before it started" in refused["detail"]
