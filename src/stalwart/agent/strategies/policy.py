"""The recovery strategy as one interface: what the agent does about an incident.

The strategies (``--strategy``) differ in what a failure costs: ``restart`` ends every
worker of the job and starts them again (torchrun's route, and the only one a plain
script can take), ``flash``/``spare`` replace the failed rank in place while the others
keep their processes and memory, ``elastic`` goes on without the failed member and lets
it rejoin. Each is one class implementing :class:`RecoveryPolicy`, chosen once from the
config (agent/strategies/__init__.py); the agent's loop never asks which one it runs.

What a policy decides: the recovery of a :class:`~stalwart.agent.detection.incidents.WorkerExited`
or :class:`~stalwart.agent.detection.incidents.NodeLost` (a hang is isolated by the agent, whose
kill comes back as a ``WorkerExited``), the variables it adds to a worker's environment,
whether the agent must stay up though every worker is done (a ``join`` still to come),
and whether hang detection may compare a worker's generation with the job's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from stalwart.agent._types import EventSink, NodeContext, Say
from stalwart.agent.cluster._cluster import Cluster
from stalwart.agent.cluster._generation import JobGeneration
from stalwart.agent.config import LaunchConfig
from stalwart.agent.detection.incidents import Incident
from stalwart.agent.processes._workers import LocalWorkers, Worker
from stalwart.chaos import FaultLedger
from stalwart.contract.env import WorkerFields
from stalwart.coordinator import Coordinator

if TYPE_CHECKING:
    from stalwart.agent.processes._standby import Standbys

__all__ = ["Launch", "RecoveryParts", "RecoveryPolicy"]


class RecoveryPolicy(Protocol):
    name: str
    """The strategy's name in the run's events (``recovery_begin``)."""
    judges_generation: bool
    """A worker waiting in a collective of an older generation is hung (False under
    elastic: its members re-form at step boundaries themselves)."""
    assigns_spares: bool
    """A replacement runs in a pre-forked spare (``--strategy spare``)."""

    def worker_env(self, worker: Worker) -> WorkerFields:
        """What this strategy adds to the environment of ``worker``'s next process."""
        ...

    def on_incident(self, incident: Incident) -> None:
        """Recover from ``incident`` (or end the job: agent/_outcome.py)."""
        ...

    def keeps_running(self) -> bool:
        """The agent stays up though no worker runs (a member may still join)."""
        ...


class Launch(Protocol):
    """What of the cluster (agent/cluster/_cluster.py) a policy uses."""

    def publish(self, key: str, record: dict[str, Any]) -> None: ...
    def published(self, key: str) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class RecoveryParts:
    """The parts a policy acts through (each the owner of its state)."""

    cfg: LaunchConfig
    workers: LocalWorkers
    generation: JobGeneration
    coord: Coordinator
    launch: Launch
    events: EventSink
    ledger: FaultLedger
    standbys: Standbys | None
    say: Say

    @classmethod
    def of(
        cls,
        ctx: NodeContext,
        workers: LocalWorkers,
        generation: JobGeneration,
        cluster: Cluster,
        standbys: Standbys | None,
    ) -> RecoveryParts:
        coord = cluster.coord
        return cls(
            ctx.cfg, workers, generation, coord, cluster, ctx.events, ctx.ledger, standbys, ctx.say
        )

    def spawn(self, w: Worker) -> None:
        self.workers.spawn(w, generation=self.generation.current)

    def joined(self, w: Worker, *, standby: bool = False) -> None:
        """``member_join`` for ``w`` at the current generation (``standby``: it runs in a
        parked standby process, agent/processes/_standby.py)."""
        more = {"standby": True} if standby else {}
        self.events.emit(
            "member_join",
            member=f"rank{w.rank}",
            node=self.cfg.node_rank,
            rank=w.rank,
            generation=self.generation.current,
            **more,
        )

    def begin(self, strategy: str, cause: str) -> None:
        self.events.emit(
            "recovery_begin", strategy=strategy, generation=self.generation.current, cause=cause
        )
