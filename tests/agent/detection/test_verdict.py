from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.agent.detection.verdict import CrashLoops, Failure, error_line, failed_at
from stalwart.contract.board import Slot


def fail(rank: int, where: str, error: str = "ValueError: bad batch") -> Failure:
    return Failure(rank, where, error, "crash")


def test_the_same_rank_at_the_same_step_k_times_is_a_verdict() -> None:
    loops = CrashLoops(3)
    assert loops.record(fail(1, "step 10")) is None
    assert loops.record(fail(1, "step 10")) is None
    line = loops.record(fail(1, "step 10", "ValueError: nan at step 10"))
    assert line is not None
    assert "rank 1" in line and "3 times" in line and "step 10" in line
    assert "ValueError: nan at step 10" in line and "--crash-loop-limit" in line
    assert "\n" not in line


def test_a_failure_elsewhere_starts_the_count_again() -> None:
    loops = CrashLoops(3)
    for where in ("step 10", "step 10", "step 11", "step 10", "step 10"):
        assert loops.record(fail(1, where)) is None
    assert loops.count(1) == 2


def test_ranks_are_counted_apart() -> None:
    loops = CrashLoops(2)
    assert loops.record(fail(0, "step 5")) is None
    assert loops.record(fail(1, "step 5")) is None
    assert loops.record(fail(0, "step 5")) is not None


def test_a_limit_of_one_ends_at_the_first_failure_and_hangs_say_so() -> None:
    line = CrashLoops(1).record(Failure(2, "step 7", "hung: stopped", "hang"))
    assert line is not None and line.startswith("rank 2 hung 1 times")


def test_where_a_worker_failed_comes_from_its_last_board_write() -> None:
    def s(phase: str, step: int, pid: int = 42) -> Slot:
        return Slot(pid, step, phase, 0, 0.0, 0.0, 0.0, True)

    assert failed_at(s("step", 9), 42) == "step 10"
    assert failed_at(s("collective", 9), 42) == "step 10"
    assert failed_at(s("paused", 9), 42) == "step 10"
    assert failed_at(s("recovering", 9), 42) == "recovery to step 9"
    assert failed_at(s("step", 9, pid=7), 42) == "start-up"  # an earlier process's slot
    assert failed_at(s("done", 20), 42) == "after step 20"


def test_the_error_line_is_read_once_else_the_exit_speaks(tmp_path: Path) -> None:
    path = tmp_path / "rank1.txt"
    path.write_text("RuntimeError: CUDA error: an illegal memory access\nmore\n")
    assert error_line(str(path), 1, "") == "RuntimeError: CUDA error: an illegal memory access"
    assert not path.exists()  # the next failure does not repeat it
    assert error_line(str(path), -9, "") == "killed by signal 9"
    assert error_line(str(path), 3, "") == "exit code 3"
    assert error_line(str(path), -9, "hung: stopped") == "hung: stopped"


def test_a_stalwart_refusal_is_a_verdict_at_once() -> None:
    error = "stalwart.errors.ConfigError: a sharded state cannot persist: use --strategy flash"
    line = CrashLoops(3).record(Failure(0, "start-up", error, "crash"))
    assert line is not None and "not restarted" in line
    assert line.endswith("a sharded state cannot persist: use --strategy flash")
    assert CrashLoops(3).record(fail(0, "start-up", "ValueError: sharded")) is None


@pytest.mark.parametrize("name", ["GroupNotFormedError", "ProcessGroupInitError"])
def test_a_collective_or_group_refused_before_the_loop_is_a_verdict_at_once(name: str) -> None:
    """A script that runs a collective before its loop (or initialises a second group)
    does so at every launch: one verdict, not a restart per --max-restarts."""
    error = f"stalwart.errors.{name}: a collective ran on the default group before ..."
    line = CrashLoops(3).record(Failure(0, "start-up", error, "crash"))
    assert line is not None and "not restarted" in line and "ran on the default" in line


def test_a_worker_that_counted_its_own_recovery_loop_is_a_verdict_at_once() -> None:
    """runtime/rejoin/_loops.py: the worker saw its step fail alike after in-place recoveries
    (no process died for the agent to count): its line is the verdict, the first time."""
    err = "stalwart.errors.RecoveryLoopError: collective failed in step 44 again after 1"
    line = CrashLoops(3).record(fail(1, "step 44", err))
    assert line == "rank 1 stopped at step 44: collective failed in step 44 again after 1"


def test_a_start_up_failure_on_every_rank_is_a_verdict_at_its_first_repeat() -> None:
    # under a whole-job restart the rank that fails first alternates: counted per rank
    # it never reached the limit before every restart was spent
    error = "ModuleNotFoundError: No module named 'missing_pkg'"
    loops = CrashLoops(3)
    assert loops.record(fail(0, "start-up", error), job_started=False) is None
    line = loops.record(fail(1, "start-up", error), job_started=False)
    assert line is not None and line.startswith("every rank failed before its first step")
    assert error in line and "rank 1" in line and "\n" not in line


def test_a_start_up_failure_while_the_job_trains_or_another_error_is_counted_per_rank() -> None:
    loops = CrashLoops(3)
    # a replacement failing at its start-up while the others train: the per-rank count
    assert loops.record(fail(1, "start-up"), job_started=True) is None
    assert loops.record(fail(1, "start-up"), job_started=True) is None
    # another error at the job's start-up (a transient one) does not repeat the first
    loops = CrashLoops(3)
    assert loops.record(fail(0, "start-up", "OSError: port in use"), job_started=False) is None
    assert loops.record(fail(1, "start-up", "ValueError: x"), job_started=False) is None
    # a step in between starts the count again
    assert loops.record(fail(0, "step 3", "ValueError: x"), job_started=True) is None
    assert loops.record(fail(1, "start-up", "ValueError: x"), job_started=False) is None
