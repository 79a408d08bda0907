"""What a worker is after it joined a generation: one :class:`Formation`, applied by the
session in one place (``Session._apply``), the only writer of its generation, rank,
world size and restored step.

Why one value: a fixed-size job and an elastic one agree on the restore point and form
the group differently (runtime/rejoin/_fixed.py, runtime/elastic/_rejoin.py), but what
they decide is the same five facts. Returned together and applied together, no part of the runtime
can see a rank of one generation with the world size of another, and the step loop
has one place where it learns where it resumes.

Both rejoins also share :func:`form_group`: build the generation's group and check its
replicas, else end the generation (if nobody has yet) so that every member retries at
the next one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from stalwart.errors import ReplicaMismatchError
from stalwart.runtime.comm._replicas import check_replicas, replicated_modules
from stalwart.runtime.comm._world import follow

if TYPE_CHECKING:
    from stalwart.coordinator import Coordinator
    from stalwart.data import BatchConfig
    from stalwart.metrics.events import EventLog
    from stalwart.runtime.comm.group import GenerationGroup

__all__ = ["Formation", "Position", "Rejoin", "end_generation", "form_group", "formed"]


@dataclass(frozen=True)
class Formation:
    """A joined generation, as the rejoin that formed it decided it."""

    generation: int
    """The generation joined: every member of it formed the same group."""
    rank: int
    """This worker's rank in it (under elastic: its place in the roster)."""
    world_size: int
    """How many members it has (under elastic: the roster's length)."""
    step: int
    """The step the tracked state is at now (restored, or kept live): the loop resumes
    after it."""
    tier: str
    """Where that state came from as agreed (memory, peer, replica, disk, live; ``none``:
    a fresh start): the ``recovery_end`` event's ``source_tier``."""
    lost: int = 0
    """Completed steps that the formation rolled back (the newest step any member had
    completed minus :attr:`step`): the ``recovery_end`` event's ``steps_lost``."""

    @property
    def fresh(self) -> bool:
        """Nothing was restored: the job starts from the script's initial state."""
        return self.tier == "none"


class Position(Protocol):
    """Where a worker stands now: read by the parts that need the live rank and
    generation (accounting, the per-rank part) and written only by the session."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def generation(self) -> int: ...


class Rejoin(Protocol):
    """How a worker joins a generation: :class:`~stalwart.runtime.rejoin._fixed.FixedRejoin`
    (the world size is the launch's; every strategy but elastic) or
    :class:`~stalwart.runtime.elastic._rejoin.ElasticRejoin` (the roster decides it). The
    session calls :meth:`join`, applies the :class:`Formation` it returns, and calls
    :meth:`adopt` before and :meth:`settle` after its own bookkeeping; the step hooks
    let an elastic job stop at a boundary for joiners."""

    @property
    def resizes(self) -> bool:
        """The world size may change between generations."""
        ...

    def on_track(self, state: Mapping[str, Any]) -> None:
        """The tracked state is known and its checkpoints are open."""

    def use_batch(self, config: BatchConfig, position: Position) -> None:
        """``Session.use_batch``: apply the batch policy now, or after every formation."""

    def join(self, min_generation: int, done: int) -> Formation:
        """Agree on a restore point at a generation >= ``min_generation``, restore the
        tracked state (``done``: the last step it completed) and form the group."""
        ...

    def adopt(self, formation: Formation) -> None:
        """The formation is applied: fit the state to it (before any snapshot of it)."""

    def settle(self, formation: Formation, seconds: float) -> None:
        """After the recovery's events (``seconds``: how long the join took)."""

    def failed(self, position: Position, reason: str) -> None:
        """A step failed (a peer died or was killed): end the job's generation so that
        every member re-forms (:func:`end_generation`); under ``--strategy async`` only
        the replica group restarts, by its agent, and this waits for that."""

    def before_step(self, done: int) -> None:
        """A step after ``done`` is about to run."""

    def after_step(self, step: int) -> bool:
        """``step`` completed; True: stop at this boundary and re-form (joiners wait)."""
        ...

    def admit(self, step: int, position: Position) -> int:
        """At the boundary after ``step``: admit the waiting joiners; returns the least
        generation to join next."""
        ...

    def finished(self, rank: int) -> None:
        """Every member trained to the end."""

    def close(self) -> None: ...


def end_generation(
    coord: Coordinator, events: EventLog | None, position: Position, reason: str
) -> None:
    """End ``position``'s generation (once: the first member to ask writes the note)."""
    gen = position.generation
    if coord.advance_generation(gen, reason).won and events is not None:
        events.emit("note", message=f"rank {position.rank} ended generation {gen}: {reason}")


def form_group(
    group: GenerationGroup,
    coord: Coordinator,
    generation: int,
    state: Mapping[str, Any],
    *,
    step: int,
    fresh: bool,
) -> bool:
    """Build ``generation``'s group, make the job's default group follow it and check
    the tracked replicas (broadcast first when ``fresh``: runtime/comm/_replicas.py); False
    when a member did not make it, after ending the generation if nobody has yet (every
    member then retries at the next one). Diverged replicas are no reason to retry:
    that error is raised."""
    try:
        group.build(generation)
        formed(group, state, step=step, fresh=fresh)
    except ReplicaMismatchError:
        raise
    except Exception:
        if coord.generation() == generation:
            coord.advance_generation(generation, "group formation failed")
        return False
    return True


def formed(group: GenerationGroup, state: Mapping[str, Any], *, step: int, fresh: bool) -> None:
    """After a build: the default group follows; replicas made equal and compared."""
    follow(group)
    check_replicas(group, replicated_modules(state), step=step, fresh=fresh)
