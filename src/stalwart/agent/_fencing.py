"""An agent that lost its lease (SIGSTOPped, partitioned, starved) is fenced.

While it was unresponsive, the leader declared its node lost, bumped the generation and
adopted its ranks. When it runs again it must not restart or replace any worker (those
ranks run elsewhere now), and its workers cannot rejoin (their joins are fenced on this
agent's member key, runtime/_coord.py). So it stops its workers and exits with a clear
message (exit code 3, like a cordoned node). Why not rejoin: the world size is fixed
and every rank has an owner again; a node coming back would have nothing to run until
elastic resizing lets it add capacity (docs/recovery.md).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from stalwart.errors import StalwartError

if TYPE_CHECKING:
    from stalwart.agent.agent import Agent

__all__ = ["NodeFenced", "check_fenced", "end_fenced"]


class NodeFenced(StalwartError):
    pass


def check_fenced(agent: Agent, *, probe: bool) -> None:
    """Raise :class:`NodeFenced` if this agent's lease is gone. ``probe``: ask the store
    (before a recovery); else only look at what the heartbeat thread found."""
    cluster = agent.cluster
    gone = cluster.fenced() if probe else cluster.lost_reason is not None
    if gone:
        raise NodeFenced(
            f"node {agent.cfg.node_rank} was fenced: {cluster.lost_reason}; its ranks were "
            "adopted by another node. Its workers are stopped and it leaves the job "
            "(start a new agent once the job can use more nodes)"
        )


def end_fenced(agent: Agent, err: NodeFenced) -> None:
    """Stop every local worker, forget the ranks another node on this host runs now
    (close() must not delete their snapshot slots), and record the isolation."""
    for w in agent.workers.values():  # exits already reaped (their events may be lost)
        try:
            if w.pid:
                os.kill(w.pid, 0)
        except ProcessLookupError:
            w.state = "dead"
    agent._stop_all("shutdown")  # "shutdown": their exits are not failures to recover
    with contextlib.suppress(Exception):
        for rank in agent.cluster.adopted_here():
            agent.workers.pop(rank, None)
    agent.events.emit(
        "isolation", member=f"node{agent.cfg.node_rank}", reason=str(err), blocklisted=False
    )
    agent.say(str(err))
