"""Whether the job has finished training, as this node can tell: one of its ranks exited
0 or passed the runtime's finish barrier (its board says ``done``), or another node
published the first of its ranks to do so (``launch/finished``, agent/_inplace.py).

Why the agent asks: the finish barrier passes for every member at once, so once one rank
finished, nobody needs a rank started again. A node lost, cordoned or isolated by a
failing probe after that point used to have its ranks adopted by the leader, which
started them afresh; they then waited in their rendezvous for peers that had exited and
the job ended with a failure instead of ``ok``. A finished job's ranks are not adopted
(:func:`skip_adoption`) and a node whose ranks finished is not isolated
(agent/_probe_watch.py ``isolate_node``).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from stalwart.agent._types import EventSink, Say
from stalwart.agent.incidents import NodeLost

__all__ = ["FINISHED", "FinishedRanks", "finished_rank", "skip_adoption"]

FINISHED = "finished"
"""The launch record of the first rank that finished the job: ``{"rank", "node"}``."""


class FinishedRanks(Protocol):
    """What of LocalWorkers (agent/_workers.py) says which local rank finished."""

    def finished_peer(self, rank: int) -> int | None: ...


class Records(Protocol):
    """The job's launch records (agent/_cluster.py)."""

    def published(self, key: str) -> dict[str, object] | None: ...


def finished_rank(
    workers: FinishedRanks, launch: Records, world_size: int, *, besides: int = -1
) -> int | None:
    """A rank other than ``besides`` that finished the job, here or on another node."""
    local = workers.finished_peer(besides)
    if local is not None:
        return local
    with contextlib.suppress(Exception):  # no store: no other node to ask
        done = (launch.published(FINISHED) or {}).get("rank")
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
