"""Chaos ``slow`` on the agent's side (agent/processes/_duty.py): the schedule, and real
processes stopped and left running."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stalwart.agent.processes._chaos import AgentChaos
from stalwart.agent.processes._duty import DUTY_PERIOD_S, DutyCycle, duty_phase
from stalwart.agent.processes._workers import Worker, WorkerState
from stalwart.chaos import FaultLedger, FaultPlan
from stalwart.contract.board import Slot


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_the_process_is_stopped_for_all_but_one_factorth_of_every_period(factor: float) -> None:
    n = 10_000
    period = 0.01
    stopped = sum(duty_phase(i * 5 * period / n, factor, period)[0] for i in range(n))
    assert stopped / n == pytest.approx(1 - 1 / factor, abs=0.01)


def test_each_wait_ends_where_the_state_changes() -> None:
    period, factor = 0.01, 4.0  # runs [0, 2.5 ms), stopped [2.5, 10 ms)
    assert duty_phase(0.001, factor, period) == (False, pytest.approx(0.0015))
    assert duty_phase(0.003, factor, period) == (True, pytest.approx(0.007))
    assert duty_phase(0.0121, factor, period) == (False, pytest.approx(0.0004))


def test_the_period_is_finer_than_a_short_step() -> None:
    """A step of 20 ms is stopped in every one (why the cycle has a thread of its own:
    the 100 ms cycle of the agent's loop left most steps of a 1.5x rank untouched)."""
    assert DUTY_PERIOD_S <= 0.02 / 2


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.001)
    return cond()


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_a_real_process_is_stopped_then_left_running_at_close(
    child: subprocess.Popen[bytes],
) -> None:
    cycle = DutyCycle(child.pid, 10.0, None)  # stopped 90% of the time
    try:
        assert _until(lambda: _state(child.pid) == "T"), "never stopped"
        assert cycle.active()
    finally:
        cycle.close()
    assert not cycle.active()
    assert _until(lambda: _state(child.pid) != "T"), "left stopped after close"


def test_the_cycle_ends_by_itself_after_its_duration(child: subprocess.Popen[bytes]) -> None:
    cycle = DutyCycle(child.pid, 10.0, 0.2)
    try:
        assert _until(lambda: not cycle.active()), "still slowing past its duration"
        assert _state(child.pid) != "T"
    finally:
        cycle.close()


def test_a_process_that_ended_is_never_signalled() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    cycle = DutyCycle(proc.pid, 3.0, None)  # reaped: its pid could be anyone's now
    assert not cycle.active()
    cycle.close()


def test_a_process_ending_mid_cycle_ends_the_cycle(child: subprocess.Popen[bytes]) -> None:
    cycle = DutyCycle(child.pid, 2.0, None)
    child.kill()
    child.wait(10)
    assert _until(lambda: not cycle.active()), "still cycling a reaped process"
    cycle.close()


class _Workers:
    """One running worker, rank 1, the child process."""

    def __init__(self, pid: int) -> None:
        self.w = Worker(1, 1, 0, pid=pid, state=WorkerState.RUNNING, attached=True)

    def __iter__(self) -> Iterator[Worker]:
        return iter([self.w])

    def get(self, rank: int) -> Worker | None:
        return self.w if rank == 1 else None

    def slot(self, w: Worker) -> Slot:
        raise AssertionError("a step-less fault reads no board")

    def ranks(self) -> list[int]:
        return [1]

    def last_step(self) -> int:
        return 0


class _Events:
    def emit(self, kind: str, **fields: object) -> None:
        pass


def test_the_agents_slow_fault_slows_the_rank_until_the_agent_closes(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    plan = FaultPlan.parse("slow rank=1 factor=10 at=time:0s")
    chaos = AgentChaos(
        list(plan.faults),
        node=0,
        answerable=[],
        run_dir=str(tmp_path),
        workers=_Workers(child.pid),
        events=_Events(),
        ledger=FaultLedger(str(tmp_path)),
        join=lambda fault: True,
        kill_node=lambda: None,
    )
    chaos.first_step = time.time()
    chaos.tick(time.time())
    try:
        assert chaos.slowed() == {child.pid}
        assert _until(lambda: _state(child.pid) == "T")
    finally:
        chaos.close()
    assert chaos.slowed() == frozenset()
    assert _until(lambda: _state(child.pid) != "T")
