"""``--strategy flash`` and ``spare``: the failed rank is replaced in place.

The survivors keep their processes and memory; the replacement (a fresh fork of the
zygote under ``flash``, a pre-forked spare under ``spare``) restores from shared memory
and the group re-forms in the next generation. A rank that fails too often is
blocklisted and the job ends with a verdict (in place, the same slot would fail again);
a node other than node 0 that fails too often cordons itself and node 0 adopts its
ranks. A lost node's ranks start on the adopter, in its standbys when ``--standby``;
under ``spare`` with ``--standby`` a failed rank resumes in its own parked standby.

A rank that fails after a peer finished the job (exited 0, or passed the runtime's finish
barrier) is not replaced either: training is over on every rank, and a replacement would
wait in its rendezvous for peers that are gone (the hang ceiling, 300 s, then again). The
job ends with one line: that rank's failure is the verdict. Each node publishes the first
of its ranks to finish (``launch/finished``, as soon as its board says ``done``) so that a
node whose rank fails later knows.
"""

from __future__ import annotations

from stalwart.agent._outcome import Cordoned, end_with_verdict
from stalwart.agent.detection._finished import (
    after_finish,
    announce_finish,
    finished_rank,
    finishing,
)
from stalwart.agent.detection.incidents import Incident, NodeLost, WorkerExited
from stalwart.agent.strategies.policy import RecoveryParts
from stalwart.contract.env import WorkerFields

__all__ = ["InPlace"]


class InPlace:
    judges_generation = True

    def __init__(self, parts: RecoveryParts, *, name: str, assigns_spares: bool) -> None:
        self._p = parts
        self.name = name
        self.assigns_spares = assigns_spares
        parts.workers.on_finish(announce_finish(parts.launch, parts.cfg.node_rank))

    def worker_env(self, worker: object) -> WorkerFields:
        return {}

    def keeps_running(self) -> bool:
        return False

    def on_incident(self, incident: Incident) -> None:
        if isinstance(incident, NodeLost):
            self._node_lost(incident)
        else:
            self._worker_exited(incident)

    def _worker_exited(self, ex: WorkerExited) -> None:
        p = self._p
        own = p.workers.slot(p.workers[ex.rank])
        if (done := finishing(ex, self._peer_finished(ex.rank), own)) is not None:
            end_with_verdict(p.launch, after_finish(ex, done))
        if ex.verdict is not None:  # it would fail the same way again
            end_with_verdict(p.launch, ex.verdict)
        member = f"rank{ex.rank}"
        counted = not ex.collateral  # another rank's fault left it behind: not its own
        if counted and p.coord.record_failure(member, ex.cause):
            # never readmitted: in place, the same slot would fail again
            p.events.emit("isolation", member=member, reason=ex.cause, blocklisted=True)
            entry = p.coord.blocklisted().get(member)
            at = f" at {ex.failure.where}: {ex.failure.error}"
            end_with_verdict(
                p.launch,
                f"rank {ex.rank} blocklisted ({entry.reason if entry else ex.cause}{at}); "
                f"the job ends: fix what makes rank {ex.rank} fail (see its log) and "
                "resume from the last checkpoint",
            )
        node = f"node{p.cfg.node_rank}"
        if counted and p.cfg.node_rank != 0 and p.coord.record_failure(node, ex.cause):
            # this machine keeps failing: take it out; node 0 adopts its ranks
            p.coord.block(node, f"cordoned after repeated failures, last: {ex.cause}")
            p.events.emit("isolation", member=node, reason=ex.cause, blocklisted=True)
            p.say(f"node {p.cfg.node_rank} failed too often: cordoned, its ranks move to node 0")
            raise Cordoned(f"node {p.cfg.node_rank} cordoned")
        p.generation.bump(f"{ex.cause} of rank {ex.rank}")
        p.begin(self.name, ex.cause)
        w = p.workers[ex.rank]
        if self.assigns_spares and p.standbys is not None and p.standbys.take(w):
            p.joined(w, standby=True)  # past its set-up already (agent/processes/_standby.py)
        else:
            p.spawn(w)

    def _node_lost(self, lost: NodeLost) -> None:
        p = self._p
        p.generation.bump(f"node {lost.node} lost")
        p.begin(self.name, "node_loss")
        for rank in lost.ranks:
            w = p.workers[rank]
            if p.standbys is not None and p.standbys.activate(w):
                p.workers.activated(w)
                p.joined(w, standby=True)
            else:
                p.spawn(w)

    def _peer_finished(self, rank: int) -> int | None:
        """A rank other than ``rank`` that finished the job, here or on another node."""
        p = self._p
        return finished_rank(p.workers, p.launch, p.cfg.world_size, besides=rank)
