"""The step transaction of ``Session.steps()`` driven from a framework's hooks.

A framework that owns the training loop (``transformers.Trainer``, Lightning) calls hooks
rather than iterating ``sess.steps()``. :class:`StepDriver` holds that generator and
advances it at the framework's step boundary, so everything the loop does between two
steps (commit, snapshot, detection, recovery, rollback) runs exactly as under a plain
loop. What the framework must do differently after a recovery, the driver says with
:class:`Rewind`: the tracked state is back at ``step``, and the framework's own loop
(its step counter, its data iterator) has to be re-entered from there.

Why the boundary is the *start* of a step (the framework's "step begin" hook, after it
fetched the step's batch): the snapshot then holds the state exactly as the next step's
compute sees it, the process RNGs included (a DataLoader iterator opened at an epoch's
start, an eval between two steps, draw from the global RNG before the hook). A re-entered
loop draws again while it opens and skips its iterator; the driver puts the restored RNG
back at the same hook (:meth:`begin`), so the redone step draws what the fault-free step
drew. Step 0's snapshot is taken at the "train begin" hook, before the first iterator,
and is put back there (:meth:`train_begin`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stalwart.checkpoint import RNGState
from stalwart.errors import StalwartError

if TYPE_CHECKING:
    from stalwart.runtime import Session

__all__ = ["Finished", "Rewind", "StepDriver"]


class Rewind(Exception):
    """The tracked state was restored to ``step``: re-enter the framework's loop there.

    Raised from a framework hook and caught by the integration's wrapper of the
    framework's ``train``/``fit`` (never seen by the user)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stalwart restored step {step}: the training loop resumes from it")
        self.step = step


class Finished(StalwartError, RuntimeError):
    """The job had finished training before this worker joined it (every member passed
    the finish barrier; a worker started again after that restores the last step and
    has no step left to run). Raised by :meth:`StepDriver.start`; the Trainer
    integration returns the restored result instead of running its loop."""

    def __init__(self, total: int) -> None:
        super().__init__(
            f"the job had already finished training ({total} steps) when this worker "
            "started: nothing is run again; its final state is the restored one"
        )
        self.total = total


class StepDriver:
    """Owns the session's step generator, the step it yielded and not yet run, the RNG
    state of a restore to put back, and the open pause (an eval or a save)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._steps: Iterator[int] | None = None
        self._pending: int | None = None  # yielded by the generator, its hook not yet run
        self._rng: dict[str, Any] | None = None  # restored RNGs, put back at the step
        self._pauses = contextlib.ExitStack()
        self._paused = False
        self.finished = False

    @property
    def started(self) -> bool:
        return self._steps is not None

    def start(self, total: int) -> None:
        """Join the job and restore (``sess.steps(total)``'s first step); the state is
        tracked by then. Raises :class:`Rewind` when the job resumes past step 0, and
        :class:`Finished` when it had already trained all ``total`` steps."""
        self._steps = self.session.steps(total)
        try:
            step = self._advance()
        except StopIteration:
            self.finished = True
            raise Finished(total) from None
        self._take(step, done=0)

    def train_begin(self, done: int) -> None:
        """The framework's loop (re-)entered at ``done`` completed steps."""
        if done == 0 and self._rng is not None:
            RNGState().load_state_dict(self._rng)  # step 0's snapshot: before the iterator
            self._rng = None

    def begin(self, done: int) -> int:
        """At the framework's step-begin hook with ``done`` steps completed: commit the
        previous step and return the number of this one (``done + 1``). Raises
        :class:`Rewind` when a recovery restored another step."""
        self.end_pause()
        if self._pending is None:
            self._take(self._advance(), done)
        step, self._pending = self._pending, None
        assert step == done + 1, f"step {step} began after {done} steps"
        if self._rng is not None:
            RNGState().load_state_dict(self._rng)
            self._rng = None
        return step

    def recover(self) -> int:
        """After a collective of the current step failed outside the step's compute (an
        eval's gather): the generator recovers; returns the step the state is back at."""
        self.end_pause()
        step = self._advance()
        self._pending = step
        self._rng = RNGState().state_dict()
        return step - 1

    def finish(self, done: int) -> None:
        """At the framework's train-end hook: the last step's commit and the job's finish
        barrier. Raises :class:`Rewind` when the barrier broke and a step is redone."""
        self.end_pause()
        if self.finished:
            return
        try:
            step = self._advance()
        except StopIteration:
            self.finished = True
            return
        self._take(step, done)

    def pause(self, what: str) -> None:
        """Open ``sess.pause(what)`` until the next step begins (an eval or a save runs
        between the framework's step-end hook and the next step-begin one)."""
        if not self._paused:
            self._pauses.enter_context(self.session.pause(what))
            self._paused = True

    def end_pause(self) -> None:
        self._pauses.close()
        self._paused = False

    def _advance(self) -> int:
        assert self._steps is not None, "StepDriver.start() was not called"
        return next(self._steps)

    def _take(self, step: int, done: int) -> None:
        """``step`` is the next to run; if it does not follow ``done``, the state was
        restored: keep its RNGs and make the framework re-enter its loop."""
        self._pending = step
        if step != done + 1:
            self._rng = RNGState().state_dict()
            raise Rewind(step - 1)
