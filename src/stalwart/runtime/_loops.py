"""In-place recoveries that fail the same way end in a verdict, never a loop.

The agent counts a rank's *deaths* at the same point (agent/verdict.py). A step can also
fail without anyone dying: the survivors of a recovery and a replacement redo a step, one
of them runs a collective the others do not (a framework callback that remembers it
already saved at that step), and the step's collective times out. Every member then
recovers in place, restores the same step, redoes the same work and fails again, one
collective timeout per round, forever, while no process exits for the agent to count.

A member that sees its generation's step fail for the same reason (the reason's first
clause: "collective failed in step 44") as the previous one, with the same processes in
the generation (their pids by rank: nobody was replaced, so nothing changed), raises
:class:`~stalwart.errors.RecoveryLoopError` at the ``limit``-th time in a row. Its one
line goes to the agent, which ends the job with it. A failure after a replacement (a
rank that died and came back) is the agent's to count: its pids differ here.
"""

from __future__ import annotations

from stalwart.errors import RecoveryLoopError

__all__ = ["RecoveryLoops"]


class RecoveryLoops:
    """One member's count of its generations' failures in a row that were alike."""

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self._last: tuple[str, tuple[int, ...]] | None = None
        self._count = 0

    def failed(self, reason: str, members: tuple[int, ...]) -> None:
        """A step of a generation formed by ``members`` (pids by rank; empty: unknown)
        failed for ``reason``; raises once it is the ``limit``-th alike in a row."""
        key = (reason.split(":")[0].strip(), members)
        if not members:
            self._last, self._count = None, 0
            return
        self._count = self._count + 1 if key == self._last else 1
        self._last = key
        if self._count >= self.limit:
            raise RecoveryLoopError(
                f"{key[0]} again after {self._count - 1} in-place "
                f"recover{'y' if self._count == 2 else 'ies'} by the same processes "
                f"(last: {reason[:200]}): the ranks do not run the same collectives when "
                "the step is redone (work that runs on some ranks only after a rollback: a "
                "callback's save, an eval); another recovery would fail the same way. "
                "events.jsonl has every failure"
            )
