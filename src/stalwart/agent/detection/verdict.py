"""Verdicts instead of loops: when a failure will only repeat, the job ends with one line.

A rank that fails at the same point of training ``limit`` times in a row (its step, or
its start-up) has a deterministic problem (a bug, a bad batch, a missing file): starting
it again, in place or with the whole job, replays the same failure forever. The agent
records every worker failure here (pure bookkeeping, tested in-process) and ends the job
with the verdict: which rank, where, the first line of the last error, what to do.

A failure before the first step on every rank (an import error, a missing file read at
start-up) is a verdict after its first repeat: the same error at start-up twice in a row,
whichever rank hit it, with no rank of the job past its start-up in between. Counted per
rank it never ended: under a whole-job restart the rank that fails first alternates (the
others are killed by the restart, which is no failure of theirs), so no rank reached the
limit before ``--max-restarts`` was spent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from stalwart.contract.board import Slot

__all__ = ["CrashLoops", "Failure", "error_line", "error_line_path", "failed_at"]


@dataclass(frozen=True)
class Failure:
    rank: int
    where: str  # "step 151", "start-up", "recovery to step 150"
    error: str  # first line of the last error ("ValueError: bad batch", "killed by signal 9")
    cause: str  # crash | hang | collateral


def failed_at(slot: Slot, pid: int) -> str:
    """Where a worker was when it died, from its last board write (``pid``: its process;
    a slot it never wrote means it died before its first step)."""
    if slot.pid != pid:
        return "start-up"
    if slot.phase in ("step", "collective", "paused"):
        return f"step {slot.step + 1}"
    if slot.phase == "recovering":
        return f"recovery to step {slot.step}"
    if slot.phase == "starting":
        return "start-up"
    return f"after step {slot.step}"


def error_line_path(run_dir: str, rank: int) -> str:
    """Where a worker of ``rank`` leaves the first line of its error (the zygote)."""
    return os.path.join(run_dir, "errors", f"rank{rank}.txt")


def error_line(path: str, rc: int, cause: str) -> str:
    """The first line of the worker's error (the zygote writes the exception's last
    traceback line to ``path``); else why the agent killed it (``cause``: "hung: ...",
    "collateral: ..."), else what its exit says."""
    try:
        with open(path, errors="replace") as f:
            text = f.read(4096).strip()
    except OSError:
        text = ""
    finally:
        if os.path.exists(path):
            os.unlink(path)
    if text:
        return text.splitlines()[0][:300]
    if cause:
        return cause
    return f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"


_REFUSALS = (  # deterministic by design: a bad flag, state or call, with the fix in the message
    "stalwart.errors.ConfigError:",
    "stalwart.errors.UnsupportedStateError:",
    "stalwart.errors.GroupNotFormedError:",  # a collective before the loop, every launch
    "stalwart.errors.ProcessGroupInitError:",  # a second init_process_group, every launch
)

_LOOP = "stalwart.errors.RecoveryLoopError: "  # a step that fails alike after recoveries


class CrashLoops:
    """Counts, per rank, failures in a row at the same point (a failure elsewhere starts
    the count again)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._last: dict[int, tuple[str, int]] = {}  # rank -> (where, count)
        self._startup: tuple[str, int] = ("", 0)  # the job's start-up failures in a row

    def record(self, failure: Failure, *, job_started: bool = True) -> str | None:
        """Count ``failure``; the verdict line once it repeated ``limit`` times, or at
        once for a stalwart refusal (it names its fix and would refuse again), or at the
        first repeat of a start-up failure while no rank of the job got past its start-up
        (``job_started`` False)."""
        if failure.error.startswith(_LOOP):  # the worker counted it (runtime/rejoin/_loops.py)
            return f"rank {failure.rank} stopped at {failure.where}: {failure.error[len(_LOOP) :]}"
        refusal = next((p for p in _REFUSALS if failure.error.startswith(p)), None)
        if refusal is not None:
            return (
                f"rank {failure.rank} refused to run at {failure.where}, not restarted "
                f"(it would refuse again): {failure.error[len(refusal) :].strip()}"
            )
        where, count = self._last.get(failure.rank, ("", 0))
        count = count + 1 if where == failure.where else 1
        self._last[failure.rank] = (failure.where, count)
        if count >= self.limit:
            return verdict(failure, count)
        return self._job_start_up(failure, job_started)

    def _job_start_up(self, failure: Failure, job_started: bool) -> str | None:
        """The job-wide count of start-up failures in a row (the same error, any rank);
        a signal (an OOM kill, a chaos kill) is no error of the script's: not counted."""
        deterministic = failure.cause == "crash" and not failure.error.startswith("killed by")
        if failure.where != "start-up" or job_started or not deterministic:
            self._startup = ("", 0)
            return None
        error, times = self._startup
        times = times + 1 if error == failure.error else 1
        self._startup = (failure.error, times)
        return startup_verdict(failure, times) if times >= 2 else None

    def count(self, rank: int) -> int:
        return self._last.get(rank, ("", 0))[1]


def startup_verdict(failure: Failure, count: int) -> str:
    return (
        f"every rank failed before its first step, {count} times in a row (last: rank "
        f"{failure.rank}: {failure.error}); it will fail the same way again: fix the cause "
        f"(rank {failure.rank}'s output has the traceback) and start the job again"
    )


def verdict(failure: Failure, count: int) -> str:
    what = "hung" if failure.cause == "hang" else "failed"
    return (
        f"rank {failure.rank} {what} {count} times in a row at {failure.where} "
        f"(last error: {failure.error}); it will fail the same way again: fix the cause "
        f"(rank {failure.rank}'s output has the traceback) and resume from the last "
        "checkpoint, or raise "
        "--crash-loop-limit if the failure is transient"
    )
