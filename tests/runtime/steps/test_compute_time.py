"""The worker's compute time (runtime/steps/_progress.py): a step's wall time less its time
blocked in collectives and pauses, summed and published on the progress board (format
version 2) for the agent's straggler detector."""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path

import pytest

from stalwart.contract.board import BoardFormatError, ProgressBoard
from stalwart.contract.env import WorkerEnv
from stalwart.runtime.steps._progress import Progress, RunDelay


class FakeDelay(RunDelay):
    """Run-queue wait as the test sets it (``now``); None: the kernel does not say."""

    def __init__(self, now: float | None = None) -> None:
        self.now = now

    def read(self) -> float | None:
        return self.now

    def close(self) -> None:
        pass


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_collective_and_pause_time_is_not_compute_time() -> None:
    progress = Progress(WorkerEnv(), lambda: (0, 0, 0.0), delay=FakeDelay())
    progress.step_started()
    _busy(0.02)
    progress.on_collective(True, failed=False)
    time.sleep(0.2)  # waiting for a slow peer
    progress.on_collective(False, failed=False)
    with progress.pause("eval"):
        time.sleep(0.2)
    progress.step_done()
    assert progress.compute_steps == 1
    # the step lasted > 0.42 s; all but ~0.02 s of it was a wait or a pause
    assert 0.02 <= progress.compute_s < 0.2


def test_a_failed_step_adds_nothing() -> None:
    progress = Progress(WorkerEnv(), lambda: (0, 0, 0.0), delay=FakeDelay())
    progress.step_started()
    _busy(0.01)
    progress.step_started()  # redone after a failed collective: never step_done'd
    progress.step_done()
    assert progress.compute_steps == 1 and progress.compute_s < 0.01


def test_time_waiting_for_a_cpu_outside_collectives_is_not_compute_time() -> None:
    # another process took the rank's core: the scheduler's time, not the rank's
    delay = FakeDelay(10.0)
    progress = Progress(WorkerEnv(), lambda: (0, 0, 0.0), delay=delay)
    progress.step_started()
    _busy(0.3)
    delay.now = 10.2  # 0.2 s of the 0.3 s computing were spent waiting in the run queue
    progress.on_collective(True, failed=False)
    delay.now = 15.0  # waits inside a collective are left out with the collective
    progress.on_collective(False, failed=False)
    with progress.pause("eval"):
        delay.now = 16.0  # and inside a pause
    progress.step_done()
    assert 0.09 <= progress.compute_s < 0.2  # ~0.3 s of wall, less the 0.2 s wait
    # where the kernel does not say, compute time is the wall time, as before
    plain = Progress(WorkerEnv(), lambda: (0, 0, 0.0), delay=FakeDelay(None))
    plain.step_started()
    _busy(0.05)
    plain.step_done()
    assert plain.compute_s >= 0.05


def test_run_delay_reads_this_threads_wait_from_the_kernel() -> None:
    delay = RunDelay()
    try:
        first = delay.read()
        if first is None:
            pytest.skip("no /proc/thread-self/schedstat on this kernel")
        _busy(0.01)
        later = delay.read()
        assert later is not None and later >= first >= 0.0
    finally:
        delay.close()
    assert delay.read() is None  # closed


def test_the_board_carries_compute_time_and_refuses_another_format(tmp_path: Path) -> None:
    path = str(tmp_path / f"board-{uuid.uuid4().hex[:6]}")
    agent_side = ProgressBoard(path, 2, create=True)
    # under `stalwart run` (a store address): nothing connects to it here
    env = dataclasses.replace(WorkerEnv(), store=("127.0.0.1", 1), progress=path, progress_slot=1)
    progress = Progress(env, lambda: (7, 3, 0.1), delay=FakeDelay())
    try:
        progress.step_started()
        _busy(0.01)
        progress.step_done()
        progress.publish()
        slot = agent_side.read(1)
        assert (slot.step, slot.generation, slot.compute_steps) == (7, 3, 1)
        assert slot.compute_s == pytest.approx(progress.compute_s) and slot.compute_s >= 0.01
    finally:
        progress.close()
        agent_side.close()
    with open(path, "r+b") as f:  # a version-1 board: no header
        f.write(bytes(64))
    with pytest.raises(BoardFormatError, match="not format version 2"):
        ProgressBoard(path, 2)
