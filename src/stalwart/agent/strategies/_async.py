"""``--strategy async``: a failed replica group is dropped, restarted, and rejoins.

The groups synchronise among themselves in the store (runtime/replica_groups/_rejoin.py,
runtime/replica_groups/_rounds.py); the agent is the authority on liveness, as under elastic. The
moment a group's worker exits, its ``alive`` key is deleted, so the other groups stop
waiting for it at the current round (they never wait for its restart: no global
barrier on a failure); then the worker is started again, and it rejoins at the next
sync boundary with the global parameters and outer state. The job's generation is not
bumped: no other group re-forms for it. A group that fails as often as the
coordinator's failure threshold allows, or crash-loops, ends the job with a verdict
(its next incarnation would fail again).
"""

from __future__ import annotations

from stalwart.agent._outcome import end_with_verdict
from stalwart.agent.detection.incidents import Incident, NodeLost, WorkerExited
from stalwart.agent.processes._workers import Worker
from stalwart.agent.strategies.policy import RecoveryParts
from stalwart.contract.env import WorkerFields, replica_group_size
from stalwart.coordinator.elastic_keys import replica_root

__all__ = ["ReplicaGroups"]


class ReplicaGroups:
    name = "async"
    judges_generation = False  # each group forms its own groups, apart from the job's
    assigns_spares = False

    def __init__(self, parts: RecoveryParts) -> None:
        self._p = parts
        self._size = replica_group_size(parts.cfg.world_size, parts.cfg.runtime.replica_groups)
        self._lives: dict[int, int] = {}  # group -> how many times it was started again

    def worker_env(self, worker: Worker) -> WorkerFields:
        """The group's life: its members name their process groups by it (a restarted
        group never dials the addresses of the one it replaces)."""
        return {"incarnation": str(self._lives.get(worker.rank // self._size, 0))}

    def keeps_running(self) -> bool:
        return False

    def on_incident(self, incident: Incident) -> None:
        if isinstance(incident, NodeLost):
            groups = sorted({rank // self._size for rank in incident.ranks})
            for group in groups:
                self._drop(group, group * self._size, "node_loss")
            self._p.begin(self.name, "node_loss")
            for group in groups:
                self._restart(group)
            return
        self._worker_exited(incident)

    def _drop(self, group: int, rank: int, cause: str) -> None:
        """``group`` leaves the rounds now: nobody waits for it."""
        p = self._p
        p.coord.store.delete(f"{replica_root(p.cfg.job)}m/alive/{group}")
        p.events.emit("replica_drop", group=group, rank=rank, cause=cause)

    def _restart(self, group: int) -> None:
        """Kill the group's other members (they wait for it in their failed step: their
        exits are no failures) and start every member again, one life later."""
        p = self._p
        members = [p.workers[r] for r in range(group * self._size, (group + 1) * self._size)]
        for w in members:
            if w.state.live and w.pid:
                p.workers.kill(w, "restart")
        self._lives[group] = self._lives.get(group, 0) + 1
        for w in members:
            p.spawn(w)

    def _worker_exited(self, ex: WorkerExited) -> None:
        p, group = self._p, ex.rank // self._size
        self._drop(group, ex.rank, ex.cause)
        if ex.verdict is not None:  # it would fail the same way again
            end_with_verdict(p.launch, ex.verdict)
        member = f"rank{ex.rank}"
        if not ex.collateral and p.coord.record_failure(member, ex.cause):
            p.events.emit("isolation", member=member, reason=ex.cause, blocklisted=True)
            at = f" at {ex.failure.where}: {ex.failure.error}"
            end_with_verdict(
                p.launch,
                f"replica group {group} (rank {ex.rank}) failed "
                f"{p.coord.config.failure_threshold} times in 10 min ({ex.cause}{at}); the job "
                f"ends: fix what makes rank {ex.rank} fail (see its log) and run it again",
            )
        p.begin(self.name, ex.cause)
        p.say(f"replica group {group} left the rounds; starting it again")
        self._restart(group)
