"""``--strategy async`` in the worker: replica groups that train apart and meet every H steps.

Each replica group (``--replica-groups G``; this part runs groups of one worker, so
group = launch rank) trains on its own data partition with its own optimizer and never
waits for another group inside a step. Every ``--sync-every H`` steps the groups
synchronise (runtime/replica_groups/_rounds.py): each contributes its parameters, the
groups that made it form the round's roster, and every group applies the same outer
step (runtime/replica_groups/_outer.py: DiLoCo's Nesterov step on the pseudo-gradient,
or LocalSGD's mean) to the agreed contributions. A group that failed is not waited for:
its agent deleted its ``alive`` key when its worker exited, so the others decide the
round without it.

A restarted group rejoins at a sync boundary: :meth:`AsyncRejoin.join` loads the newest
published global state (parameters and the outer optimizer's state), restoring its own
memory snapshot of that step first when it has one (optimizer moments, loader position,
RNG), and announces itself, so it is expected from the next round on. The outer state
travels in the store's global record of each round (not yet in the group's snapshots).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from stalwart.errors import ConfigError
from stalwart.logs import get_logger
from stalwart.runtime.comm._formation import Formation, Position, formed
from stalwart.runtime.replica_groups._outer import OuterConfig, OuterOptimizer, decode, encode
from stalwart.runtime.replica_groups._rounds import RoundError, Rounds
from stalwart.runtime.state._memory_tier import memory_steps, restore_memory_step

if TYPE_CHECKING:
    from stalwart.contract.env import WorkerEnv
    from stalwart.coordinator import Coordinator, Store
    from stalwart.data import BatchConfig
    from stalwart.metrics.events import EventLog
    from stalwart.runtime.comm.group import GenerationGroup
    from stalwart.runtime.state._tracking import TrackedState

__all__ = ["AsyncRejoin", "group_of", "group_position"]

_log = get_logger(__name__)


def group_of(env: WorkerEnv) -> tuple[int, int, int]:
    """(replica group, rank in it, its size) of this worker (contract/env.py)."""
    assert env.replica_group is not None, "only under --strategy async"
    return env.replica_group


def group_position(env: WorkerEnv) -> tuple[int, int, str]:
    """(rank, world size, namespace) of this worker's DDP group: the job's, or under
    ``--strategy async`` its replica group's (named apart: each forms on its own)."""
    if env.replica_group is None:
        return env.rank, env.world_size, env.job
    index, rank, size = env.replica_group
    return rank, size, f"{env.job}.g{index}"


class AsyncRejoin:
    """:class:`~stalwart.runtime.comm._formation.Rejoin` of one replica group."""

    resizes = False

    def __init__(
        self,
        env: WorkerEnv,
        group: GenerationGroup,
        tracked: TrackedState,
        coord: Coordinator,
        store: Store,
        events: EventLog | None,
    ) -> None:
        self.env, self.group, self.tracked = env, group, tracked
        self.outer = OuterOptimizer(OuterConfig(lr=env.outer_lr, momentum=env.outer_momentum))
        self.coord, self.events = coord, events
        self.index, self.member, self.size = group_of(env)
        self.lead = self.member == 0  # the group's voice in the rounds (its replicas agree)
        self.groups = env.replica_groups or env.world_size
        self.every = env.sync_every
        # the group's life, counted by its agent (agent/strategies/_async.py): its members
        # name their process groups by it, so a restarted group never dials its predecessor's
        self.lives = int(env.incarnation) if env.incarnation.isdigit() else 0
        self.inc = env.incarnation or uuid.uuid4().hex[:8]
        self.rounds = Rounds(store, env.job, self.index, self.groups, env.hang_ceiling_s)
        self.params: dict[str, torch.Tensor] = {}
        self.formation: Formation | None = None

    def on_track(self, state: Mapping[str, Any]) -> None:
        """The parameters that synchronise: every tracked module's, by tracked name."""
        self.params = {
            f"{key}.{name}": p
            for key, obj in state.items()
            if isinstance(obj, torch.nn.Module)
            for name, p in obj.named_parameters()
        }
        if not self.params:
            raise ConfigError(
                "--strategy async synchronises the tracked models' parameters and none is "
                "tracked: pass the model to sess.track(model=...)"
            )
        # the outer state is checkpointed with the group's own: snapshots, persists and
        # their restores carry the round's start parameters and the momentum
        self.tracked.add("_outer", self.outer)

    def use_batch(self, config: BatchConfig, position: Position) -> None:
        raise ConfigError(
            "sess.use_batch under --strategy async: each replica group keeps its own batch; "
            "drop the call (or use --strategy elastic)"
        )

    # ------------------------------------------------------------ joining
    def join(self, min_generation: int, done: int) -> Formation:
        if self.formation is not None:  # only a first join: a failed step waits in failed()
            return self.formation
        # the job's generation (never bumped under async): every group finishes in it
        gen = max(min_generation, self.coord.generation())
        # a restarted group (a later life) rejoins at a round its members agree on
        latest = self.rounds.rejoin_round(self.inc, self.rounds.latest()) if self.lives else None
        self.group.build(gen + self.lives)
        if not self.lives and self.index != 0:  # a first life: round 0, or newer if late
            start = self.rounds.start_round(self.inc, self.env.hang_ceiling_s)
            latest = start if start > 0 else None  # round 0: read by _initial
        rank, world = self.env.rank, self.env.world_size
        if latest is not None:
            step, lost = self._receive(latest, rejoin=self.lives > 0)
            formed(self.group, self.tracked.state, step=step, fresh=False)
            self.formation = Formation(gen, rank, world, step, "transfer", lost)
            return self.formation
        self._initial()
        if self.lead:
            self.rounds.announce(self.inc, 0)
        step = self._resume()
        formed(self.group, self.tracked.state, step=step, fresh=step == 0)
        self.formation = Formation(gen, rank, world, step, "disk" if step else "none")
        return self.formation

    def _initial(self) -> None:
        """Every group starts from group 0's parameters, published as round 0 with the
        outer state (as DDP's constructor broadcasts rank 0's): a script that seeds its
        model by rank (nanoGPT's ``1337 + rank``) would otherwise start each group
        elsewhere, and the outer step, computed by every group from its own start,
        would differ. A group that starts late, when group 0 went on alone and published
        newer rounds, starts from the newest instead (:meth:`Rounds.start_round`,
        :meth:`_receive`): the rounds between were decided without it, and are pruned."""
        if self.index != 0:  # round 0 is published (start_round waited) and never pruned
            params = decode(self.rounds.global_state(0))
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(params[f"p/{name}"])
        self.outer.begin(self.params)
        if self.index == 0 and self.lead:
            self.rounds.publish(0, self._global())

    def _resume(self) -> int:
        """A launch with persisted checkpoints (a reused ``--run-dir``): the newest step
        every group holds on disk, restored (the outer state with it), its round done
        again when it is a boundary (a boundary's snapshot precedes its round); 0: none."""
        if self.env.persist_every == 0:
            return 0
        held = self.tracked.checkpoints.steps()
        common = self.rounds.persisted(held if self.lead else None)
        if not common:
            return 0
        step = common[-1]
        self.tracked.restore_disk(step)
        if step % self.every == 0 and step // self.every > self.outer.round:
            self._sync(step // self.every, step)
        _log.info("replica group %d resumed from its checkpoint of step %d", self.index, step)
        return step

    def _receive(self, round_: int, rejoin: bool) -> tuple[int, int]:
        """Load the global state after ``round_`` (own snapshot of its step first):
        a restarted group's rejoin, or (``rejoin`` False) a first life's late start."""
        t0 = time.perf_counter()
        step = round_ * self.every
        snap = self.tracked.snapshots
        held = memory_steps(snap)
        common = self.rounds.held_by_all(self.inc, self.member, self.size, held)
        own = max((s for s in common if s <= step), default=None)
        if own is not None:  # its optimizer moments and RNG, then the global parameters
            restore_memory_step(snap, self.tracked.state, own)
        blob = self.rounds.global_state(round_)
        self._load(round_, blob)
        if self.lead:
            self.rounds.announce(self.inc, round_)
        if not rejoin:  # nothing failed: no replica_rejoin, no recovery_end (settle)
            if self.lead and self.events is not None:
                self.events.emit(
                    "note",
                    message=f"replica group {self.index} started late: from round "
                    f"{round_} (step {step}), the newest published",
                )
            _log.info("replica group %d started late: round %d (step %d)", self.index, round_, step)
            return step, 0
        if self.lead and self.events is not None:
            self.events.emit(
                "replica_rejoin",
                group=self.index,
                round=round_,
                step=step,
                own_snapshot=own is not None,
                bytes=len(blob),
                seconds=time.perf_counter() - t0,
            )
        _log.info("replica group %d rejoined at round %d (step %d)", self.index, round_, step)
        return step, max(0, max(held, default=step) - step)

    def _load(self, round_: int, blob: bytes) -> None:
        state = decode(blob)
        params = {k[2:]: v for k, v in state.items() if k.startswith("p/")}
        momentum = {k[2:]: v for k, v in state.items() if k.startswith("m/")}
        self.outer.load_state_dict({"round": round_, "start": params, "momentum": momentum})
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(params[name])

    def _global(self) -> bytes:
        state = {f"p/{k}": v for k, v in self.outer.start.items()}
        state.update({f"m/{k}": v for k, v in self.outer.momentum.items()})
        return encode(state)

    # ------------------------------------------------------------ the step loop
    def after_step(self, step: int) -> bool:
        if step % self.every == 0 and step // self.every > self.outer.round:
            self._sync(step // self.every, step)
        return False

    def _sync(self, round_: int, step: int) -> None:
        """Round ``round_``: contribute, agree, apply the outer step (or, late, adopt)."""
        t0 = time.perf_counter()
        rounds = self.rounds
        roster = rounds.agreed(round_)
        if roster is None:
            if self.lead:
                rounds.contribute(round_, encode(self.params))
            roster = rounds.agree(round_)
        if self.index not in roster:  # decided without this group: adopt its result
            self._load(round_, rounds.global_state(round_, self.env.hang_ceiling_s))
            return
        new = self.outer.step([decode(rounds.contribution(round_, g)) for g in roster])
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(new[name])
        # by the leader: the group's members would write the same chunks under one prefix
        if self.lead and rounds.publish(round_, self._global()):
            rounds.prune(round_)
        if self.lead and self.index == roster[0] and self.events is not None:
            self.events.emit(
                "replica_sync",
                round=round_,
                step=step,
                members=roster,
                dropped=[g for g in range(self.groups) if g not in roster],
                seconds=time.perf_counter() - t0,
            )

    # ------------------------------------------------------------ the rest of Rejoin
    def adopt(self, formation: Formation) -> None:
        """Each worker reads its launch rank's slice (a group's partition is its
        members' slices): tracked loaders sharded by the launch, not the DDP group."""
        for obj in self.tracked.state.values():
            reshard = getattr(obj, "reshard", None)
            if callable(reshard):
                reshard(world_size=self.env.world_size, rank=self.env.rank)

    def settle(self, formation: Formation, seconds: float) -> None:
        """A rejoin's recovery_end (the session writes one only past generation 0, which
        async never leaves: its groups rejoin on their own)."""
        rejoined = formation.tier == "transfer" and self.lives > 0  # not a late start
        if rejoined and self.lead and self.events is not None:
            self.events.emit(
                "recovery_end",
                strategy=self.env.strategy,
                generation=formation.generation,
                restored_step=formation.step,
                steps_lost=formation.lost,
                source_tier=formation.tier,
                ok=True,
            )

    def failed(self, position: Position, reason: str) -> None:
        """A member of this replica group died or hung: its agent drops the group and
        kills and starts all of its members again (agent/strategies/_async.py); the job's
        generation is not ended, no other group re-forms. Wait for that kill."""
        _log.info("replica group %d failed (%s): waiting for its agent", self.index, reason)
        threading.Event().wait(self.env.hang_ceiling_s)
        raise RoundError(
            f"replica group {self.index}'s step failed ({reason}) and its agent did not "
            f"restart it within {self.env.hang_ceiling_s:.0f} s: see the agent's log"
        )

    def before_step(self, done: int) -> None:
        pass

    def admit(self, step: int, position: Position) -> int:
        return position.generation

    def finished(self, rank: int) -> None:
        pass

    def close(self) -> None:
        pass
