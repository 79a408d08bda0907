"""The worker's line on its agent's progress board: phase, last progress, heartbeat.

The agent judges hangs by what this line says (agent/progress.py): the phase (a rank in
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
    from stalwart.agent.progress import ProgressBoard
    from stalwart.runtime.env import WorkerEnv

__all__ = ["Progress", "Status"]

Status = Callable[[], tuple[int, int, float]]
"""(last completed step, generation, p99 step time) at the moment of a write."""


class Progress:
    def __init__(self, env: WorkerEnv, status: Status) -> None:
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
        self._status = status
        self._stop = threading.Event()
        self._board: ProgressBoard | None = None
        if env.managed and env.progress:
            from stalwart.agent.observe import detach
            from stalwart.agent.progress import ProgressBoard

            detach()  # the zygote watched this worker as a plain script until now
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
        self._t_step = time.perf_counter()
        self.publish("step")

    def step_done(self) -> None:
        """The step that began at :meth:`step_started` completed: add its compute time
        (published with the next write). A failed step adds nothing (it is redone)."""
        wall = time.perf_counter() - self._t_step
        self.compute_s += max(0.0, wall - self.paused_s - self._collective_s)
        self.compute_steps += 1

    def on_collective(self, entering: bool, failed: bool) -> None:
        now = time.perf_counter()
        if self.paused:
            pass  # inside a pause: already left out of the step's compute time
        elif entering:
            self._t_collective = now
        elif self._t_collective is not None:
            self._collective_s += now - self._t_collective
            self._t_collective = None
        # a failed collective means recovery is next: never look like a stuck computation
        after = "paused" if self.paused else "step"
        self.publish("collective" if entering else "recovering" if failed else after)

    @contextlib.contextmanager
    def pause(self, what: str) -> Iterator[None]:
        """``Session.pause``: the board says ``paused`` until the outermost block ends."""
        t0 = time.perf_counter()
        self.paused.append(what)
        self.publish("paused")
        try:
            yield
        finally:
            self.paused.pop()
            if not self.paused:
                self.paused_s += time.perf_counter() - t0
                self.t_progress = time.time()  # the pause ended: progress, not a stall
                self.publish("step")

    def _heartbeat(self) -> None:
        while not self._stop.wait(0.1):
            if self._board is not None:
                self._board.touch(self.slot, time.time())

    def close(self) -> None:
        self._stop.set()
