"""``--strategy elastic`` in the worker: shrink on a failure, grow on a join, no restarts.

A *member* is named for life by the rank it was launched with (``RANK`` at start; its
snapshot namespace ``SlotNames.rank(member)``) plus an *incarnation* (one per process the agent
starts for it). Each generation has a *roster*, decided once in the store
(``el/roster/<gen>``, create-if-absent): the previous roster's members that are still
alive (the agents keep ``el/alive/<member>`` = incarnation) plus the joiners admitted
into that generation. Ranks are the roster's order, dense from 0; the world size is its
length.

Shrink: a survivor whose step failed bumps the generation (as under ``flash``) and the
survivors undo the failed step in memory (:mod:`stalwart.runtime.elastic._live`) and agree on
the last step every member completed (else the newest step they all hold in memory; the
agents drop the dead member from ``el/alive`` within the crash-detection latency),
renumber, rebuild the group and go on: nobody waits for a replacement. Grow: see
:mod:`stalwart.runtime.elastic._joiners`; the survivors stop at one step boundary, where their
live state *is* the join point (no restore), for a snapshot, the second transfer and the
group's re-formation (the roster: :mod:`stalwart.runtime.elastic._roster`; the admission:
:mod:`stalwart.runtime.elastic._grow`). :class:`ElasticRejoin` composes the two, returns a
:class:`~stalwart.runtime.comm._formation.Formation` like the fixed rejoin does, and keeps
what is elastic about the step loop (live rollback, the stop vote).
After every formation the batch plan (``Session.use_batch``) is recomputed and applied
(loader resharded, micro-batches, LR scale) and rank 0 writes a ``resize`` event when
the world size changed.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from stalwart.logs import get_logger
from stalwart.runtime.comm._formation import Formation, Position, end_generation, form_group
from stalwart.runtime.elastic._grow import JoinAdmission
from stalwart.runtime.elastic._joiners import Keys
from stalwart.runtime.elastic._live import LiveRollback
from stalwart.runtime.elastic._roster import ElasticWaitError, Roster
from stalwart.runtime.rejoin._rendezvous import choose
from stalwart.runtime.state._memory_tier import memory_steps, restore_memory_step
from stalwart.runtime.state._perrank import derive_rng

if TYPE_CHECKING:
    from stalwart.contract.env import WorkerEnv
    from stalwart.coordinator import Coordinator, Store
    from stalwart.data import BatchConfig
    from stalwart.metrics.events import EventLog
    from stalwart.runtime.comm.group import GenerationGroup
    from stalwart.runtime.state._tracking import TrackedState

__all__ = ["ElasticRejoin", "ElasticWaitError", "join_point"]

Infos = dict[int, dict[str, Any]]

_log = get_logger(__name__)


def job_token(env: WorkerEnv, store: Store) -> bytes:
    """The job token that authenticates state transfers between members. With
    ``--rdzv etcd://`` and a shared ``--token-file``, the file, checked against
    etcd's verifier (``launch/token-check``); with etcd alone, ``launch/token``, which
    the agents store only in an etcd that refuses clients without credentials
    (agent/cluster/etcd.py); else the launcher's token file."""
    from stalwart.coordinator.token import check_token, read_token_file
    from stalwart.errors import ConfigError

    if not env.rdzv:
        return read_token_file(env.token_file)
    if store.get(f"/stalwart/{env.job}/launch/token-check") is not None:
        token = read_token_file(env.token_file)
        check_token(store, env.job, token, env.token_file, create=False)
        return token
    kv = store.get(f"/stalwart/{env.job}/launch/token")
    if kv is None:
        raise ConfigError(
            f"job {env.job}: no token in etcd (launch/token); start the "
            "workers with `stalwart run --rdzv etcd://...`"
        )
    return bytes(kv.value)


def join_point(infos: Infos, disk: int | None) -> tuple[int | None, str]:
    """The step every member can be at: the survivors' live step when they all
    completed the same one (and joiners hold it), else the newest common snapshot."""
    lives = {int(i["live"]) for i in infos.values() if i.get("live") is not None}
    if len(lives) == 1:
        live = lives.pop()
        if all(i.get("live") == live or live in i.get("steps", []) for i in infos.values()):
            return live, "live"
    target, tier = choose(list(infos.values()), disk, use_memory=True)
    if tier in ("memory", "peer"):
        return target, tier
    # no step common to all: the joiners' transferred step may be none of the
    # survivors'; take the survivors' newest common one, joiners copy it from a peer
    survivors = [i for i in infos.values() if i.get("done") or i.get("live") is not None]
    if (
        survivors
        and len(survivors) < len(infos)
        and all(i.get("replicated") for i in infos.values())
    ):
        common, how = choose(survivors, None, use_memory=True)
        if how == "memory":
            return common, "peer"
    return target, tier


class ElasticRejoin:
    """:class:`~stalwart.runtime.comm._formation.Rejoin` whose world is the roster's."""

    resizes = True

    def __init__(
        self,
        env: WorkerEnv,
        group: GenerationGroup,
        tracked: TrackedState,
        coord: Coordinator,
        store: Store,
        events: EventLog | None,
        on_finished: Callable[[], None],
    ) -> None:
        self.env, self.group, self.tracked = env, group, tracked
        self.coord, self.store, self.events = coord, store, events
        self.member = env.rank  # the launch rank names the member for life
        self.inc = env.incarnation or "0"
        self.keys = Keys(env.job)
        self.roster = Roster(store, coord, env, self.keys, self.member, self.inc)
        self.admission = JoinAdmission(
            store,
            coord,
            env,
            self.keys,
            (self.member, self.inc),
            job_token(env, store),
            tracked,
            events,
            on_finished,
        )
        self.batch: BatchConfig | None = None
        self.world = 0  # size of the last group formed (0: none yet)
        self.admitted = False  # this process is in a roster
        self.clean_step: int | None = None  # the live state is exactly this step's
        self.live: LiveRollback | None = None
        self.members: set[int] = set()  # the current group's members
        self._fields: dict[str, Any] = {}  # the batch plan applied at the last formation
        group.signal_slot = True

    def on_track(self, state: Mapping[str, Any]) -> None:
        """After ``Session.track``: prepare live rollback (nothing is installed on the
        tracked objects: a failed step's scheduler step is undone, not skipped)."""
        self.live = LiveRollback(state)

    def use_batch(self, config: BatchConfig, position: Position) -> None:
        """Validate the policy for the job's world range; applied after every formation."""
        from stalwart.errors import ConfigError

        if config.policy == "compatible":
            raise ConfigError(
                "batch policy 'compatible' needs standby members, which the elastic runtime "
                "does not run yet; use 'exact' or 'nearest'"
            )
        config.validate(self.env.min_world, self.env.world_size)
        self.batch = config

    # ------------------------------------------------------------ the step loop
    def failed(self, position: Position, reason: str) -> None:
        assert self.coord is not None
        end_generation(self.coord, self.events, position, reason)

    def before_step(self, done: int) -> None:
        if self.live is not None:
            self.live.capture(done)
        self.clean_step = None
        self.group.signal = 1.0 if self.admission.has_ready() else 0.0

    def after_step(self, step: int) -> bool:
        self.clean_step = step
        if self.group.signalled:  # some member voted to stop here: a joiner is ready
            self.group.signalled = False
            return True
        return False

    def admit(self, step: int, position: Position) -> int:
        """Stop at the boundary after ``step``: rank 0 admits the prefetched joiners
        into the next generation, the others wait for it to move on."""
        gen = position.generation
        if position.rank == 0:
            self.admission.admit(gen, step, 0, position.world_size, self.members)
        else:
            self.admission.wait_generation(gen, self.env.hang_ceiling_s)
        return gen + 1

    # ------------------------------------------------------------ joining
    def join(self, min_generation: int, done: int) -> Formation:
        if self.clean_step is None and self.live is not None and self.live.rollback(done):
            self.clean_step = done  # the failed step undone in memory
        while True:
            if not self.admitted and self.roster.formed_before():
                min_generation = max(min_generation, self.admission.await_admission())
            agreed = self.roster.agree(min_generation, self._info(done))
            if agreed is None:  # counted out (or not admitted yet): join as a joiner
                self.admitted, self.clean_step = False, None
                min_generation = self.coord.generation()
                continue
            gen, roster, infos = agreed
            members = [m for m, _ in roster]
            rank, world = members.index(self.member), len(members)
            target, tier = join_point(infos, self.tracked.disk_step() if gen == 0 else None)
            if gen == 0 and target is None:
                tier = "none"
            done = self._restore(target, tier, infos)
            self.admitted = True
            self.clean_step = done
            if world < self.env.min_world:
                self.members = set(members)
                self._wait_for_members(gen, rank, world, done)
                min_generation = gen + 1
                continue
            self.group.resize(rank, world)
            state = self.tracked.state
            if not form_group(self.group, self.coord, gen, state, step=done, fresh=target is None):
                min_generation = gen + 1
                continue
            self.members = set(infos)
            last = max(int(i.get("done", 0)) for i in infos.values())
            return Formation(gen, rank, world, done, tier, lost=max(0, last - done))

    def _info(self, done: int) -> dict[str, Any]:
        return {
            "member": self.member,
            "inc": self.inc,
            # clean survivors need no snapshot: do not wait for one in flight
            "steps": self.tracked.snapshots.steps(wait=self.clean_step is None),
            "live": self.clean_step,
            "done": done,
            "host": socket.gethostname(),
            "replicated": self.tracked.replicated,
        }

    def _restore(self, target: int | None, tier: str, infos: Infos) -> int:
        """Bring the tracked state to ``target``; returns the step it is at now."""
        t = time.perf_counter()
        if target is None:
            return 0
        if tier == "live" and self.clean_step == target:
            return target  # a survivor at the join point: nothing to load
        self.clean_step = None
        tracked = self.tracked
        snap = tracked.snapshots
        if target in memory_steps(snap):
            nbytes, tier = restore_memory_step(snap, tracked.state, target), "memory"
        elif tier in ("memory", "peer", "live"):
            holders = sorted(infos.items())
            nbytes, tier = tracked.restore_peer(target, holders, f"member {self.member}"), "peer"
        else:
            nbytes = tracked.restore_disk(target)
        received = self.admission.received
        if received is not None and received.get("step") == target:
            tier = "transfer"  # a joiner: the state came from a survivor's memory
        if tracked.part is not None and tier in ("peer", "disk"):
            tracked.part.restore(target, tier)  # the own part over the peer's / rank 0's
        elif tier == "transfer":
            derive_rng(self.member, target)  # not the survivor's RNG stream
        if self.events is not None:
            self.events.emit(
                "restore", step=target, tier=tier, seconds=time.perf_counter() - t, bytes=nbytes
            )
        return target

    def _wait_for_members(self, gen: int, rank: int, world: int, step: int) -> None:
        need = self.env.min_world
        if rank == 0 and self.events is not None:
            self.events.emit("waiting", have=world, need=need, reason="below the minimum world")
        _log.warning(
            "%d member(s) left, the job needs at least %d: waiting up to %.0fs for members to join",
            world,
            need,
            self.env.elastic_wait_s,
        )
        if rank == 0:
            self.admission.admit(gen, step, need - world, world, self.members)
        else:
            self.admission.wait_generation(gen, self.env.elastic_wait_s)

    # ------------------------------------------------------------ formed
    def adopt(self, formation: Formation) -> None:
        """The new rank and size: the environment a script reads, the batch plan."""
        rank, world = formation.rank, formation.world_size
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        self._fields = self._apply_plan(rank, world)

    def settle(self, formation: Formation, seconds: float) -> None:
        """A ``resize`` event when the world size changed; rank 0 watches for joiners."""
        old, world, rank = self.world, formation.world_size, formation.rank
        self.world = world
        grow = self.admission.take_grow()
        if rank == 0 and self.events is not None and old and old != world:
            fields = self._fields
            stall = time.perf_counter() - grow["t0"] if grow else seconds
            self.events.emit(
                "resize",
                generation=formation.generation,
                from_world_size=old,
                reason="grow" if world > old else "shrink",
                step=formation.step,
                stall_s=stall,
                transfer_bytes=int(grow.get("bytes", 0)),
                transfer_s=float(grow.get("seconds", 0.0)),
                **fields,
            )
            word = "grew" if world > old else "shrank"
            _log.info(
                "generation %d: %s %d -> %d workers at step %d (%s micro-batches/rank)",
                formation.generation,
                word,
                old,
                world,
                formation.step,
                fields.get("micro_batches", 1),
            )
        self.admission.watch(rank == 0, self.members)

    def _apply_plan(self, rank: int, world: int) -> dict[str, Any]:
        from stalwart.data import apply_plan, plan_batch

        state = self.tracked.state
        if self.batch is not None:
            plan = plan_batch(self.batch, world, min_world=self.env.min_world)
            if rank < plan.world_size:
                return apply_plan(state, plan, rank)
            return {"world_size": world, "micro_batches": plan.micro_batches}
        for obj in state.values():  # no policy: reshard loaders, keep their batch
            reshard = getattr(obj, "reshard", None)
            if callable(reshard):
                reshard(world_size=world, rank=rank)
        return {"world_size": world, "micro_batches": 1}

    def finished(self, rank: int) -> None:
        """The group trained to the end: joiners still waiting exit."""
        if rank == 0:
            self.store.put(self.keys.finished, b"1")
        self.close()

    def close(self) -> None:
        self.admission.close()
