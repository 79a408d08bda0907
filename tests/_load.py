"""How long a test waits on a loaded machine: the one place that says it.

The suite runs beside other work (CI neighbours, a second ``make test``, five sessions on
two cores), where a job that takes 40 s on a quiet machine takes ten times as long. A
fixed wall-clock limit then fails a test that is only slow, so no test waits on one:

- **Load factor.** ``load_factor()`` is the 1-minute load average divided by the CPUs
  this process may run on, at least 1 and at most ``MAX_FACTOR``: about how many times
  slower than on a quiet machine a CPU-bound process runs now. A test's limit is its base
  (the figure in the test, sized for a quiet machine with room to spare) times that
  factor.
- **Per test.** The pytest-timeout limit of every test (``timeout = 120`` in
  pyproject.toml, or the test's ``@pytest.mark.timeout(N)``) is scaled by the factor
  measured when the test starts (tests/conftest.py).
- **Per wait.** A wait on a process or a condition (``wait_job``, ``wait_until``)
  re-measures the factor on every poll (the deadline only moves later), and a job wait
  also moves its deadline while the job shows progress: while its events file or its
  output grows, it is slow, not stuck. It still ends: never later than
  ``PROGRESS_CAP`` times the load-scaled base after the wait began, and the per-test
  limit stands behind it.

``STALWART_TEST_LOAD_FACTOR`` (a number) overrides the measured factor, e.g. to rerun a
failure with the limits it had under load.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "MAX_FACTOR",
    "PROGRESS_CAP",
    "Deadline",
    "load_factor",
    "node_lease",
    "scaled",
    "wait_job",
    "wait_until",
]

MAX_FACTOR = 16.0
"""A load average beyond 16 per CPU is a machine that is not running the tests at all."""

PROGRESS_CAP = 3.0
"""A job that keeps showing progress may run this many times its load-scaled base."""

_POLL_S = 0.5


def load_factor() -> float:
    """How many times slower than on a quiet machine a process runs now (1..MAX_FACTOR)."""
    forced = os.environ.get("STALWART_TEST_LOAD_FACTOR")
    if forced:
        return min(max(float(forced), 1.0), MAX_FACTOR)
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - no load average on this platform
        return 1.0
    return min(max(load / len(os.sched_getaffinity(0)), 1.0), MAX_FACTOR)


def scaled(base_s: float) -> float:
    """``base_s`` (seconds on a quiet machine) for the load now."""
    return base_s * load_factor()


def node_lease(base_s: float = 2.0) -> str:
    """A ``--node-lease`` value for a test job: ``base_s`` (a short lease, for fast node-loss
    detection on a quiet machine) scaled for the load, up to 5x: an agent starved of CPU
    on a loaded machine missed a 2 s lease's renewals and its node was fenced, a failure
    of the machine, not of the code under test."""
    return f"{min(scaled(base_s), 5 * base_s):.1f}"


class Deadline:
    """A deadline of ``base_s`` x the load factor, re-measured at every ``expired()``
    (it only moves later); ``progress()`` restarts it from now, up to ``PROGRESS_CAP``
    x the scaled base from the start."""

    def __init__(self, base_s: float) -> None:
        self.base_s = base_s
        self.started = time.monotonic()
        self._since = self.started
        self._factor = load_factor()

    @property
    def limit_s(self) -> float:
        """The load-scaled base, in seconds (as of the last ``expired()``)."""
        return self.base_s * self._factor

    def progress(self) -> None:
        self._since = time.monotonic()

    def expired(self) -> bool:
        self._factor = max(self._factor, load_factor())
        now = time.monotonic()
        if now - self.started > PROGRESS_CAP * self.limit_s:
            return True
        return now - self._since > self.limit_s

    def describe(self) -> str:
        """One line for a failure message: how long it waited and why it stopped."""
        waited = time.monotonic() - self.started
        return (
            f"{waited:.0f} s (base {self.base_s:.0f} s x load factor {self._factor:.1f}, "
            f"no progress for {time.monotonic() - self._since:.0f} s)"
        )


def wait_until(predicate: Callable[[], bool], base_s: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds (True) or the load-scaled deadline passes (False)."""
    deadline = Deadline(base_s)
    while not predicate():
        if deadline.expired():
            return False
        time.sleep(interval)
    return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def wait_job(
    proc: subprocess.Popen[str], base_s: float, progress: Sequence[Path] = ()
) -> tuple[str, str]:
    """``proc.communicate()`` with a load-scaled deadline that moves while any file in
    ``progress`` (a job's events file) or the job's output grows; returns (stdout,
    stderr). Past the deadline the job gets SIGTERM (it cleans up), then SIGKILL if it
    does not end, and an AssertionError says how long it waited, with the job's stderr."""
    deadline = Deadline(base_s)
    marks: tuple[int, ...] = ()
    while True:
        try:
            out, err = proc.communicate(timeout=_POLL_S)
        except subprocess.TimeoutExpired as exc:
            # communicate keeps what it read so far (a retry loses nothing): the output
            # read up to now counts as progress too
            now = (len(exc.output or b""), len(exc.stderr or b""), *map(_size, progress))
            if now != marks:
                marks = now
                deadline.progress()
            if deadline.expired():
                break
            continue
        return out or "", err or ""
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=scaled(20))
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    raise AssertionError(
        f"the job did not end in {deadline.describe()}; its stderr:\n{(err or '')[-4000:]}"
    )
