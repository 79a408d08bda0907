"""Chaos ``slow`` on the agent's side: a process run 1/factor of the time by SIGSTOP and
SIGCONT, in a thread of its own.

Why a thread and a 10 ms period: a straggler worth finding (a throttled or weaker device,
a slower link) slows *every* step alike, and the straggler detector scores the median
step of a window (agent/detection/stragglers.py). A duty cycle of 100 ms, driven by the
agent's 20 ms loop, stopped a 40 ms-step job for 33 ms in one step of two or three at
1.5x: the median step did not move and a 1.5x rank was never declared, though its job ran
1.5x slower. At 10 ms every step of 20 ms or more is stopped several times, so the
injected slowdown is the uniform one it stands for. The state follows the phase of the
clock (not a count of wakes), so a late wake on a loaded machine shortens one phase and
the next is on time: the process runs ``1/factor`` of the time on average whatever the
wakes' jitter.

Signals go through a pidfd: a process that ended and whose pid was reused is never
signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

__all__ = ["DUTY_PERIOD_S", "DutyCycle", "duty_phase"]

DUTY_PERIOD_S = 0.01
"""The period of the stop/run cycle: finer than any step it slows (module docstring)."""


def duty_phase(elapsed_s: float, factor: float, period_s: float) -> tuple[bool, float]:
    """At ``elapsed_s`` into a duty cycle: (stopped, seconds until the state changes).
    The process runs the first ``period / factor`` of each period and is stopped for the
    rest."""
    running_s = period_s / factor
    phase = elapsed_s % period_s
    if phase < running_s:
        return False, running_s - phase
    return True, period_s - phase


class DutyCycle:
    """One process slowed ``factor`` x from now on, for ``duration_s`` (None: until
    :meth:`close`); the process is left running (SIGCONT) at the end either way."""

    def __init__(
        self,
        pid: int,
        factor: float,
        duration_s: float | None,
        *,
        period_s: float = DUTY_PERIOD_S,
    ) -> None:
        if factor < 1.0 or period_s <= 0:
            raise ValueError(f"duty cycle factor {factor} < 1 or period {period_s} <= 0")
        self.pid, self.factor, self.duration_s, self.period_s = pid, factor, duration_s, period_s
        self._fd: int | None = None
        with contextlib.suppress(OSError):  # gone already: nothing to slow
            self._fd = os.pidfd_open(pid)
        self._end = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"slow-{pid}", daemon=True)
        if self._fd is not None:
            self._thread.start()

    def active(self) -> bool:
        """Still slowing its process (not ended, not past its duration, the process
        alive)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """End the cycle now and leave the process running."""
        self._end.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if self._fd is not None and not self._thread.is_alive():
            os.close(self._fd)
            self._fd = None

    def _run(self) -> None:
        t0, stopped = time.monotonic(), False
        try:
            while not self._end.is_set():
                elapsed = time.monotonic() - t0
                if self.duration_s is not None and elapsed >= self.duration_s:
                    break
                want, wait_s = duty_phase(elapsed, self.factor, self.period_s)
                if want != stopped:
                    self._signal(signal.SIGSTOP if want else signal.SIGCONT)
                    stopped = want
                self._end.wait(wait_s)
        except ProcessLookupError:
            return  # the process ended: nothing to leave running
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        assert self._fd is not None
        signal.pidfd_send_signal(self._fd, sig)
