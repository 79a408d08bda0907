"""``--strategy restart``: torchrun's route, every worker of the job starts again.

Also the route of a plain script (one that never calls ``stalwart.init()``) under any
strategy: it cannot re-form in place. Every node restarts its workers when one does:
the node that saw the failure bumps the generation with a reason starting with
"restart" and publishes a fresh ``MASTER_PORT`` under it; the others follow
(agent/cluster/_generation.py). Each restart counts against ``--max-restarts``.

Never once a rank finished the job (agent/detection/_finished.py): a plain script restarted then
resumes from its own snapshot and trains its last epochs again, ending rc 0 with another
result. A rank that fails after a peer finished ends the job with its failure instead.
"""

from __future__ import annotations

from stalwart.agent._outcome import RunFailed, end_with_verdict
from stalwart.agent.detection._finished import (
    after_finish,
    announce_finish,
    finished_rank,
    finishing,
)
from stalwart.agent.detection.incidents import Incident, NodeLost
from stalwart.agent.strategies.policy import RecoveryParts
from stalwart.contract.env import WorkerFields

__all__ = ["RestartAll"]


class RestartAll:
    name = "restart"
    judges_generation = True
    assigns_spares = False

    def __init__(self, parts: RecoveryParts) -> None:
        self._p = parts
        parts.workers.on_finish(announce_finish(parts.launch, parts.cfg.node_rank))

    def worker_env(self, worker: object) -> WorkerFields:
        return {}

    def keeps_running(self) -> bool:
        return False

    def on_incident(self, incident: Incident) -> None:
        if isinstance(incident, NodeLost):
            self.restart_all(f"loss of node {incident.node}", "node_loss")
            return
        p = self._p
        peer = finished_rank(p.workers, p.launch, p.cfg.world_size, besides=incident.rank)
        done = finishing(incident, peer, p.workers.slot(p.workers[incident.rank]))
        if done is not None:  # the job is finishing: never restarted from a checkpoint
            end_with_verdict(p.launch, after_finish(incident, done))
        if incident.verdict is not None:  # it would fail the same way again
            end_with_verdict(p.launch, incident.verdict)
        if p.generation.restarts >= p.cfg.max_restarts:
            p.say(f"rank {incident.rank} failed and --max-restarts={p.cfg.max_restarts} is spent")
            f = incident.failure
            raise RunFailed(
                f"rank {incident.rank} failed at {f.where} ({f.error}); no restarts left"
            )
        self.restart_all(f"{incident.cause} of rank {incident.rank}", incident.cause)

    def restart_all(self, what: str, cause: str) -> None:
        """torchrun's route for the whole job: every node restarts its workers."""
        p = self._p
        if p.generation.restarts >= p.cfg.max_restarts:
            p.say(f"{what}: --max-restarts={p.cfg.max_restarts} is spent")
            raise RunFailed(f"{what}; no restarts left")
        p.launch.publish("last-done", {"step": p.workers.last_step() or 0})
        p.generation.restart(what)
        p.begin("restart", cause)
        self.restart_local()

    def follow(self) -> None:
        """Another node restarted the job: restart here too, on its port."""
        p = self._p
        if p.generation.restarts >= p.cfg.max_restarts:
            raise RunFailed("another node restarted the job and no restarts are left")
        p.generation.follow_port()
        self.restart_local()

    def restart_local(self) -> None:
        """Every local worker is killed and started again (standbys too: they belong to
        the killed launch; the next reconcile starts new ones)."""
        p = self._p
        if p.standbys is not None:
            p.standbys.close()
        p.generation.restarted()
        p.workers.stop_all("restart")
        p.say(f"restarting all workers (restart {p.generation.restarts}/{p.cfg.max_restarts})")
        for w in p.workers:
            p.spawn(w)
