"""In-place recoveries that fail the same way end in a verdict, never a loop.

The agent counts a rank's *deaths* at the same point (agent/detection/verdict.py). A step can also
fail without anyone dying: the survivors of a recovery and a replacement redo a step, one
of them runs a collective the others do not (a framework callback that remembers it
already saved at that step), and the step's collective times out. Every member then
recovers in place, restores the same step, redoes the same work and fails again, one
collective timeout per round, forever, while no process exits for the agent to count.

A member counts its generations' failures for the same reason (the reason's first
clause: "collective failed in step 44") after which the next generation formed with the
same processes as the one that failed (their pids by rank): nobody died, nobody was
replaced, so nothing changed that could make the next attempt differ. At the ``limit``-th
in a row it raises :class:`~stalwart.errors.RecoveryLoopError`; its one line goes to the
agent, which ends the job with it. A generation that failed because a member was lost
(a kill, a hang, a lost node, still dying while the generation formed) forms the next
one with another pid, and the count starts again: a rank that dies at the same step
every time is the agent's crash loop, with the rank and its error.
"""

from __future__ import annotations

from stalwart.errors import RecoveryLoopError

__all__ = ["RecoveryLoops"]


class RecoveryLoops:
    """One member's count of the failures in a row that changed nothing."""

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self._pending: tuple[str, tuple[int, ...], str] | None = None  # failed, not re-formed
        self._last: tuple[str, tuple[int, ...]] | None = None
        self._count = 0

    def failed(self, reason: str, members: tuple[int, ...], same_cause: str = "") -> None:
        """A step of the generation formed by ``members`` (who, compared only: a digest of
        their pids by rank, _rendezvous.members_of; empty: unknown)
        failed for ``reason``: judged when the next generation forms. ``same_cause`` is
        why the generation ended as the coordinator recorded it: counted only when a
        member ended it for this failure (same first clause), not the agent for a lost
        member (then the job moved on, and ``reason`` is that it was left)."""
        what = reason.split(":")[0].strip()
        counted = same_cause.split(":")[0].strip() == what
        self._pending = (what, members, reason) if counted else ("", (), reason)

    def formed(self, members: tuple[int, ...]) -> None:
        """The generation after a failure formed with ``members``; raises at the
        ``limit``-th failure in a row alike after which nothing changed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        what, before, reason = pending
        if not members or members != before:
            self._last, self._count = None, 0
            return
        key = (what, members)
        self._count = self._count + 1 if key == self._last else 1
        self._last = key
        if self._count >= self.limit:
            raise RecoveryLoopError(
                f"{what}, {self._count} times in a row, each time recovered in place by the "
                f"same processes (last: {reason[:200]}): the ranks do not run the same "
                "collectives when the step is redone (work that runs on some ranks only "
                "after a rollback: a callback's save, an eval); another recovery would fail "
                "the same way. events.jsonl has every failure"
            )
