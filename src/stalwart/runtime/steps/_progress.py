"""The worker's line on its agent's progress board: phase, last progress, heartbeat.

The agent judges hangs by what this line says (contract/board.py): the phase (a rank in
``paused`` or ``collective`` is never blamed for its step time), the time of the last
progress and a heartbeat touched every 100 ms by a daemon thread. Outside ``stalwart
run`` there is no board and :class:`Progress` only keeps the phase and the pause time
(the step loop leaves a pause out of the step time either way).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalwart.contract.board import ProgressBoard
    from stalwart.contract.env import WorkerEnv

__all__ = ["Progress", "RunDelay", "Status"]

Status = Callable[[], tuple[int, int, float]]
"""(last completed step, generation, p99 step time) at the moment of a write."""


class RunDelay:
    """Seconds the calling thread has waited for a CPU while runnable (the kernel's
    ``run_delay``, /proc/thread-self/schedstat), read at every step and collective edge.

    Why: the straggler score compares ranks' compute time, and on a shared machine a
    rank's compute time swings 2-3x for 10 s at a time when other processes take its
    core (measured: a fault-free rank seen at 3.3x its peer for 4 windows in a row at
    load 28 on 2 cores). Time spent waiting in the run queue is the scheduler's, not the
    rank's: the time a throttled or slow device, a SIGSTOP or a slower kernel costs is
    not run delay and stays in. ``read()`` is None where the kernel does not say (no
    schedstat): compute time is then the wall time, as before."""

    def __init__(self) -> None:
        self._fd: int | None = None
        with contextlib.suppress(OSError):
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        if self.read() is None:
            self.close()

    def read(self) -> float | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class Progress:
    def __init__(self, env: WorkerEnv, status: Status, *, delay: RunDelay | None = None) -> None:
        self.slot = env.progress_slot
        self.phase = "starting"
        self.t_progress = time.time()
        self.paused: list[str] = []  # open sess.pause(...) blocks, innermost last
        self.paused_s = 0.0  # time paused within the current step (not step time)
        self.compute_s = 0.0  # completed steps' time outside collectives and pauses
        self.compute_steps = 0  # steps summed into compute_s
        self._t_step = time.perf_counter()
        self._collective_s = 0.0  # blocked in collectives within the current step
        self._t_collective: float | None = None
        # run-queue waits at the step's start, and within its collectives and pauses
        self._delay = delay if delay is not None else RunDelay()
        self._rd_step: float | None = None
        self._rd_collective: float | None = None
        self._rd_excluded = 0.0
        self._status = status
        self._stop = threading.Event()
        self._board: ProgressBoard | None = None
        if env.managed and env.progress:
            from stalwart.contract.board import ProgressBoard, runtime_attaches

            runtime_attaches()  # the zygote watched this worker as a plain script until now
            self._board = ProgressBoard(env.progress, env.progress_slot + 1)
            threading.Thread(target=self._heartbeat, name="stalwart-alive", daemon=True).start()

    def publish(self, phase: str | None = None) -> None:
        if phase is not None:
            self.phase = phase
        if self._board is not None:
            step, generation, p99 = self._status()
            self._board.write(
                self.slot,
                pid=os.getpid(),
                step=step,
                phase=self.phase,
                generation=generation,
                t_progress=self.t_progress,
                t_alive=time.time(),
                p99_s=p99,
                compute_s=self.compute_s,
                compute_steps=self.compute_steps,
            )

    def progressed(self) -> None:
        """A step completed (or the state moved to a restored one)."""
        self.t_progress = time.time()

    def step_started(self) -> None:
        self.paused_s = 0.0
        self._collective_s, self._t_collective = 0.0, None
        self._rd_excluded, self._rd_collective = 0.0, None
        self._rd_step = self._delay.read()
        self._t_step = time.perf_counter()
        self.publish("step")

    def step_done(self) -> None:
        """The step that began at :meth:`step_started` completed: add its compute time
        (published with the next write), less the time its thread waited for a CPU
        outside collectives (:class:`RunDelay`). A failed step adds nothing (it is
        redone)."""
        wall = time.perf_counter() - self._t_step
        compute = max(0.0, wall - self.paused_s - self._collective_s)
        rd = self._delay.read()
        if rd is not None and self._rd_step is not None:
            waited = max(0.0, rd - self._rd_step - self._rd_excluded)
            compute = max(0.02 * compute, compute - waited)
        self.compute_s += compute
        self.compute_steps += 1

    def on_collective(self, entering: bool, failed: bool) -> None:
        now = time.perf_counter()
        if self.paused:
            pass  # inside a pause: already left out of the step's compute time
        elif entering:
            self._t_collective, self._rd_collective = now, self._delay.read()
        elif self._t_collective is not None:
            self._collective_s += now - self._t_collective
            self._t_collective = None
            rd = self._delay.read()
            if rd is not None and self._rd_collective is not None:
                self._rd_excluded += rd - self._rd_collective
        # a failed collective means recovery is next: never look like a stuck computation
        after = "paused" if self.paused else "step"
        self.publish("collective" if entering else "recovering" if failed else after)

    @contextlib.contextmanager
    def pause(self, what: str) -> Iterator[None]:
        """``Session.pause``: the board says ``paused`` until the outermost block ends."""
        t0, rd0 = time.perf_counter(), self._delay.read()
        self.paused.append(what)
        self.publish("paused")
        try:
            yield
        finally:
            self.paused.pop()
            if not self.paused:
                self.paused_s += time.perf_counter() - t0
                rd = self._delay.read()
                if rd is not None and rd0 is not None:
                    self._rd_excluded += rd - rd0  # the pause's waits are not compute
                self.t_progress = time.time()  # the pause ended: progress, not a stall
                self.publish("step")

    def _heartbeat(self) -> None:
        while not self._stop.wait(0.1):
            if self._board is not None:
                self._board.touch(self.slot, time.time())

    def close(self) -> None:
        self._stop.set()
        self._delay.close()
