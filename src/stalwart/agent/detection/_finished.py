"""Whether the job has finished training, as this node can tell: one of its ranks exited
0 or passed the runtime's finish barrier (its board says ``done``), or another node
published the first of its ranks to do so (``launch/finished``, agent/strategies/_inplace.py).

Why the agent asks: the finish barrier passes for every member at once, so once one rank
finished, nobody needs a rank started again. A node lost, cordoned or isolated by a
failing probe after that point used to have its ranks adopted by the leader, which
started them afresh; they then waited in their rendezvous for peers that had exited and
the job ended with a failure instead of ``ok``. A finished job's ranks are not adopted
(:func:`skip_adoption`) and a node whose ranks finished is not isolated
(agent/health/_node.py ``isolate_node``).

A job whose ranks have begun to exit cleanly is finishing, never failing: a rank that
fails after a peer finished ends the job with its failure (:func:`after_finish`), never a
restart from a checkpoint (a plain script would resume from its own snapshot, train its
last epochs again and end rc 0 with another result), and a rank that makes no progress
for ``--exit-grace`` seconds once a peer finished is ended and counted as finished
(:class:`ExitWatch`): the job ends with its result, rc 0, and one line saying so. Such a
rank is stuck in its teardown (a gloo group's destructor waiting for a thread that waits
for the GIL, agent/processes/_zygote.py) or alone with nothing left to wait for: its peers are gone,
so no collective of the job can ever complete.

Only a rank that could have finished is counted so: a plain script's (no finish barrier to
tell), or one of the runtime's whose board says ``done`` (it passed the barrier itself). A
runtime rank idle short of ``done`` did not finish, whatever its peers did: a peer can pass
the barrier on an arrival its member left there before giving up on it (its peer was away
for the hang ceiling), e.g. under ``--strategy async`` a group restarted after its start-up
failed finishes alone while the other waits in its recovery. Ending that rank as finished
ended the job ok without its result; it is a hang instead (``ExitHang.unfinished``): its
strategy recovers it (async: its group starts again and rejoins) or, a peer having
finished, ends the job with its failure (:func:`after_finish`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from stalwart.agent._types import EventSink, Say
from stalwart.agent.detection.hang import Activity
from stalwart.agent.detection.incidents import NodeLost, WorkerExited
from stalwart.contract.board import Slot

__all__ = [
    "FINISHED",
    "ExitHang",
    "ExitWatch",
    "FinishedRanks",
    "after_finish",
    "announce_finish",
    "finished_rank",
    "finishing",
    "finishing_rank",
    "hung_at_exit",
    "skip_adoption",
]

FINISHED = "finished"
"""The launch record of the first rank that finished the job: ``{"rank", "node"}``."""


class FinishedRanks(Protocol):
    """What of LocalWorkers (agent/processes/_workers.py) says which local rank finished."""

    def finished_peer(self, rank: int) -> int | None: ...


class Records(Protocol):
    """The job's launch records (agent/cluster/_cluster.py)."""

    def published(self, key: str) -> dict[str, object] | None: ...


class Followed(Protocol):
    """A launch record as a watch on it saw it (agent/cluster/_cluster.py)."""

    def followed(self, key: str) -> dict[str, object] | None: ...


class Publisher(Records, Protocol):
    def publish(self, key: str, record: dict[str, Any]) -> None: ...


class _Ranked(Protocol):
    rank: int


def announce_finish(launch: Publisher, node: int) -> Callable[[_Ranked], None]:
    """The listener (``LocalWorkers.on_finish``) that tells the other nodes of the first
    of this node's ranks to finish the job (the ``finished`` record, once)."""

    def finished(w: _Ranked) -> None:
        with contextlib.suppress(Exception):  # the store host may be leaving already
            if launch.published(FINISHED) is None:
                launch.publish(FINISHED, {"rank": w.rank, "node": node})

    return finished


def finishing(ex: WorkerExited, peer: int | None, slot: Slot) -> int | None:
    """The rank whose finish makes ``ex`` a failure after the job finished: a peer that
    finished (``peer``), else ``ex``'s own rank when its last board write (``slot``)
    says it had passed the finish barrier (every member trained to the end, whatever
    its peers' boards say yet)."""
    if peer is not None:
        return peer
    return ex.rank if slot.pid == ex.pid and slot.phase == "done" else None


def after_finish(ex: WorkerExited, done: int) -> str:
    """The verdict of a rank that failed once a peer (``done``) had finished the job, or
    (``done`` its own rank) after it passed the finish barrier itself."""
    where = ex.failure.where
    at = where if where.startswith("after") else f"at {where}"
    if done == ex.rank:
        return (
            f"rank {ex.rank} failed {at} ({ex.failure.error}) after the job had finished "
            "training (every rank passed the finish barrier): not restarted, nothing is "
            f"left to train and its peers are leaving; the job ends with rank {ex.rank}'s "
            f"failure: fix what runs after training (rank {ex.rank}'s output has the "
            "traceback); the final checkpoint is complete"
        )
    return (
        f"rank {ex.rank} failed {at} ({ex.failure.error}) when rank {done} had finished the job "
        f"(exited 0): not restarted, its peers are gone and a replacement would wait for "
        f"them; the job ends with rank {ex.rank}'s failure: fix it (rank {ex.rank}'s output "
        "has the traceback) and resume from the last checkpoint"
    )


@dataclass(frozen=True)
class ExitHang:
    """Ranks that made no progress for ``grace_s`` after rank ``done`` finished:
    ``ranks`` are ended and counted as finished, ``unfinished`` (the runtime's, short of
    the finish barrier) are hangs, never finishes."""

    ranks: list[int]
    done: int  # the rank whose clean exit (or finish barrier) began the job's end
    idle_s: float  # how long the first of them made no progress
    grace_s: float
    unfinished: list[int] = field(default_factory=list)

    def line(self, rank: int, step: int) -> str:
        return (
            f"rank {rank} hung at exit: no progress for {self.idle_s:.0f} s after rank "
            f"{self.done} finished the job (--exit-grace {self.grace_s:g}); ended, not "
            f"restarted: the job's result stands (rank {rank}'s last step: {step})"
        )

    def short_of_finish(self, slot: Slot) -> str:
        """How an ``unfinished`` rank hung (its ``WorkerHung``'s ``how``)."""
        return (
            f"no progress after rank {self.done} finished the job, but it never passed the "
            f"finish barrier itself (its last step {slot.step}, phase {slot.phase}): not a "
            "finish"
        )


def hung_at_exit(
    slots: Mapping[int, Slot],
    activity: Mapping[int, Activity],
    now: float,
    *,
    done: int,
    since: float,
    grace_s: float,
    runtime: Collection[int] = (),
) -> ExitHang | None:
    """The live ranks (``slots``, as for agent/detection/hang.py ``find_hang``) that neither
    computed nor stepped for ``grace_s`` since ``since`` (when the agent learned that
    rank ``done`` finished the job). A busy rank (a final eval or save alone) is never
    ended; a stopped one is, after the same grace (nobody will ever wait for it).
    ``runtime``: the ranks known to run the stalwart runtime (their slot may be a
    start-up's yet); one of them, or an attached slot, short of ``done`` is unfinished."""
    idle = {
        r: now - max(since, activity[r].t_busy, s.t_progress)
        for r, s in slots.items()
        if r in activity
    }
    late = sorted(r for r, d in idle.items() if d > grace_s)
    if not late:
        return None
    short = [r for r in late if (slots[r].attached or r in runtime) and slots[r].phase != "done"]
    ended = [r for r in late if r not in short]
    return ExitHang(ended, done, min(idle[r] for r in late), grace_s, short)


class ExitWatch:
    """Whether the job is finishing (a rank finished it: ``finished()``), since when as
    this agent saw it, and which ranks then hung at exit."""

    def __init__(self, finished: Callable[[], int | None], grace_s: float) -> None:
        self._finished, self.grace_s = finished, grace_s
        self._done: int | None = None
        self._since = 0.0

    def check(
        self,
        slots: Mapping[int, Slot],
        activity: Mapping[int, Activity],
        now: float,
        runtime: Collection[int] = (),
    ) -> tuple[bool, ExitHang | None]:
        """(finishing, the ranks to end); while not finishing, hang detection goes on."""
        if self._done is None:
            self._done = self._finished()
            if self._done is None:
                return False, None
            self._since = now
        hang = hung_at_exit(
            slots,
            activity,
            now,
            done=self._done,
            since=self._since,
            grace_s=self.grace_s,
            runtime=runtime,
        )
        return True, hang


def finished_rank(
    workers: FinishedRanks, launch: Records, world_size: int, *, besides: int = -1
) -> int | None:
    """A rank other than ``besides`` that finished the job, here or on another node (the
    other nodes' record read from the store: an exit is judged by it)."""
    return _finished(workers, lambda: launch.published(FINISHED), world_size, besides)


def finishing_rank(workers: FinishedRanks, launch: Followed, world_size: int) -> int | None:
    """:func:`finished_rank` for a look on every turn of the agent's loop
    (:class:`ExitWatch`): the other nodes' record as a watch on it saw it, no request."""
    return _finished(workers, lambda: launch.followed(FINISHED), world_size, -1)


def _finished(
    workers: FinishedRanks,
    record: Callable[[], dict[str, object] | None],
    world_size: int,
    besides: int,
) -> int | None:
    local = workers.finished_peer(besides)
    if local is not None:
        return local
    with contextlib.suppress(Exception):  # no store: no other node to ask
        done = (record() or {}).get("rank")
        if isinstance(done, int) and 0 <= done < world_size and done != besides:
            return done
    return None


def skip_adoption(lost: NodeLost, done: int | None, events: EventSink, say: Say) -> bool:
    """True (with a ``note`` and a line) when ``lost``'s ranks must not be adopted:
    rank ``done`` finished the job, so they trained to the end too (or would wait for
    peers that are gone); the job ends normally once this node's ranks exit."""
    if done is None:
        return False
    why = (
        f"node {lost.node} left after rank {done} finished the job: its ranks "
        f"{list(lost.ranks)} are not adopted (training is over; started again they "
        "would wait for peers that have exited)"
    )
    events.emit("note", message=why)
    say(why)
    return True
