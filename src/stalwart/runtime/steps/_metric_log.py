"""``sess.log(loss=..., lr=...)`` as events, sampled so that the log stays small.

Why sampled: a value per step is ~150 bytes; a two-week run at 10 steps/s would write
gigabytes. The loss curve needs every step only where it changes fast (the start, and
right after each resumption, which elastic convergence compares to a reference run);
elsewhere one value per few seconds draws the same curve. So rank 0 writes the values
of every completed step for the first :data:`FIRST` steps and the first
:data:`AFTER_RESUME` after each recovery, then at most one step per :data:`INTERVAL_S`,
and always the last step's (when the loop ends). ``loss`` becomes a ``loss`` event (the
report's loss curve, ``stalwart report --reference``), any other name a ``metric`` event.

Values are read (``.item()``) only when written: a tensor logged at a step that is not
written costs nothing (no device sync). A failed step's values are dropped (the step is
redone), and a non-finite value is not written (JSON has no NaN): a note says so once.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.metrics.events import EventLog

__all__ = ["AFTER_RESUME", "FIRST", "INTERVAL_S", "MetricLog"]

FIRST = 200
AFTER_RESUME = 20
INTERVAL_S = 5.0


class MetricLog:
    """Rank 0's sampler (other ranks keep nothing)."""

    def __init__(
        self,
        events: EventLog | None,
        *,
        first: int = FIRST,
        after_resume: int = AFTER_RESUME,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.events = events
        self.first = first
        self.after_resume = after_resume
        self.interval_s = interval_s
        self.pending: dict[str, Any] = {}  # this step's values, not yet read
        self._held: tuple[int, int, dict[str, Any]] | None = None  # newest unwritten step
        self._done = 0  # completed steps seen
        self._resumed = 0  # completed steps since the last recovery
        self._last_t = -math.inf
        self._warned: set[str] = set()

    def log(self, values: dict[str, Any]) -> None:
        if self.events is None:
            return
        for name, value in values.items():
            if hasattr(value, "detach"):
                value = value.detach()  # not the autograd graph: only the value is kept
            self.pending[name] = value

    def step_done(self, step: int, generation: int, now: float | None = None) -> None:
        """Step ``step`` completed: write its values if due, else hold them (the last
        step's are written by :meth:`flush`)."""
        values, self.pending = self.pending, {}
        if self.events is None:
            return
        self._done += 1
        self._resumed += 1
        now = time.monotonic() if now is None else now
        due = (
            self._done <= self.first
            or self._resumed <= self.after_resume
            or now - self._last_t >= self.interval_s
        )
        if not values:
            return
        if due:
            self._held = None
            self._last_t = now
            self._write(step, generation, values)
        else:
            self._held = (step, generation, values)

    def recovered(self) -> None:
        """After a rollback: steps after the restore point are redone; the values held
        for one of them are stale, and the next steps are written densely again."""
        self.pending = {}
        self._held = None
        self._resumed = 0

    def flush(self) -> None:
        """Write the newest held step's values (the loop ended)."""
        held, self._held = self._held, None
        if held is not None:
            self._write(*held)

    def _write(self, step: int, generation: int, values: dict[str, Any]) -> None:
        assert self.events is not None
        for name, raw in values.items():
            try:
                value = float(raw.item() if hasattr(raw, "item") else raw)
            except (TypeError, ValueError, RuntimeError):
                self._note(name, f"sess.log({name}=...) is not a number; not recorded")
                continue
            if not math.isfinite(value):
                self._note(
                    name,
                    f"{name} was {value} at step {step}; "
                    "non-finite values are not recorded (JSON has no NaN)",
                )
                continue
            if name == "loss":
                self.events.emit("loss", step=step, value=value, generation=generation)
            else:
                self.events.emit("metric", name=name, step=step, value=value, generation=generation)

    def _note(self, name: str, message: str) -> None:
        if name in self._warned or self.events is None:
            return
        self._warned.add(name)
        self.events.emit("note", message=message)
