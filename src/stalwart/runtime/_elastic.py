"""``--strategy elastic`` in the worker: shrink on a failure, grow on a join, no restarts.

A *member* is named for life by the rank it was launched with (``RANK`` at start; its
snapshot namespace ``SlotNames.rank(member)``) plus an *incarnation* (one per process the agent
starts for it). Each generation has a *roster*, decided once in the store
(``el/roster/<gen>``, create-if-absent): the previous roster's members that are still
alive (the agents keep ``el/alive/<member>`` = incarnation) plus the joiners admitted
into that generation. Ranks are the roster's order, dense from 0; the world size is its
length.

Shrink: a survivor whose step failed bumps the generation (as under ``flash``) and the
survivors undo the failed step in memory (:mod:`stalwart.runtime._live`) and agree on
the last step every member completed (else the newest step they all hold in memory; the
agents drop the dead member from ``el/alive`` within the crash-detection latency),
renumber, rebuild the group and go on: nobody waits for a replacement. Grow: see
:mod:`stalwart.runtime._joiners`; the survivors stop at one step boundary, where their
live state *is* the join point (no restore), for a snapshot, the second transfer and the
group's re-formation (the roster and the admission: :mod:`stalwart.runtime._membership`).
After every formation the batch plan (``Session.use_batch``) is recomputed and applied
(loader resharded, micro-batches, LR scale) and rank 0 writes a ``resize`` event when
the world size changed.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from stalwart.checkpoint.slots import SlotNames
from stalwart.errors import ReplicaMismatchError
from stalwart.runtime._joiners import JoinWatcher, Keys
from stalwart.runtime._live import LiveRollback
from stalwart.runtime._membership import ElasticWaitError, Membership
from stalwart.runtime._memory import memory_steps, restore_memory_step
from stalwart.runtime._perrank import derive_rng
from stalwart.runtime._rendezvous import choose

if TYPE_CHECKING:
    from stalwart.data import BatchConfig
    from stalwart.runtime.session import Session

__all__ = ["Elastic", "ElasticWaitError", "use_batch"]


def use_batch(sess: Session, config: BatchConfig) -> None:
    """``Session.use_batch``: validate the policy for the job's world range; the elastic
    runtime applies it after every formation, a fixed-size job once now."""
    from stalwart.data import apply_plan, plan_batch
    from stalwart.errors import ConfigError

    if config.policy == "compatible" and sess._elastic is not None:
        raise ConfigError(
            "batch policy 'compatible' needs standby members, which the elastic runtime "
            "does not run yet; use 'exact' or 'nearest'"
        )
    config.validate(sess.env.min_world, sess.env.world_size)
    if sess._elastic is not None:
        sess._elastic.batch = config
    else:
        apply_plan(sess._state, plan_batch(config, sess.world_size), sess.rank)


def _job_token(sess: Session) -> bytes:
    """The job token that authenticates state transfers between members: in etcd under
    ``launch/token`` with ``--rdzv etcd://`` (agent/_etcd_cluster.py; no file is
    written), else the launcher's token file."""
    from stalwart.coordinator.token import read_token_file
    from stalwart.errors import ConfigError

    if not sess.env.rdzv:
        return read_token_file(sess.env.token_file)
    kv = sess.store.get(f"/stalwart/{sess.env.job}/launch/token")
    if kv is None:
        raise ConfigError(
            f"job {sess.env.job}: no token in etcd (launch/token); start the "
            "workers with `stalwart run --rdzv etcd://...`"
        )
    return bytes(kv.value)


class Elastic(Membership):
    def __init__(self, sess: Session) -> None:
        self.sess = sess
        env = sess.env
        self.member = env.rank  # the launch rank names the member for life
        self.inc = env.incarnation or "0"
        self.keys = Keys(env.job)
        self.names = SlotNames(env.job, env.shm_run)
        self.token = _job_token(sess)
        self.batch: BatchConfig | None = None
        self.world = 0  # size of the last group formed (0: none yet)
        self.admitted = False  # this process is in a roster
        self.clean_step: int | None = None  # the live state is exactly this step's
        self.watcher: JoinWatcher | None = None
        self._grow: dict[str, Any] | None = None  # the resize in progress (rank 0)
        self._received: dict[str, Any] | None = None  # what this joiner was sent
        self.live: LiveRollback | None = None
        self._members: set[int] = set()  # the current group's members
        sess.group.signal_slot = True

    def tracked(self, state: dict[str, Any]) -> None:
        """After ``Session.track``: prepare live rollback (nothing is installed on the
        tracked objects: a failed step's scheduler step is undone, not skipped)."""
        self.live = LiveRollback(state)

    # ------------------------------------------------------------ the step loop
    def before_step(self) -> None:
        if self.live is not None:
            self.live.capture(self.sess.step)
        self.clean_step = None
        w = self.watcher
        self.sess.group.signal = 1.0 if w is not None and w.has_ready() else 0.0

    def after_step(self, step: int) -> None:
        self.clean_step = step
        group = self.sess.group
        if group.signalled:  # some member voted to stop here: a joiner is ready
            group.signalled = False
            self.grow(step)

    @staticmethod
    def _target(infos: dict[int, dict[str, Any]], disk: int | None) -> tuple[int | None, str]:
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

    # ------------------------------------------------------------ joining
    def join(self, min_generation: int) -> None:
        sess = self.sess
        sess._publish("recovering")
        t0 = time.perf_counter()
        snap = sess._ckpt.snapshots
        if self.clean_step is None and self.live is not None and self.live.rollback(sess.step):
            self.clean_step = sess.step  # the failed step undone in memory
        while True:
            if not self.admitted and self._formed_before():
                min_generation = max(min_generation, self._await_admission())
            info = {
                "member": self.member,
                "inc": self.inc,
                # clean survivors need no snapshot: do not wait for one in flight
                "steps": snap.steps(wait=self.clean_step is None),
                "live": self.clean_step,
                "done": sess.step,
                "host": socket.gethostname(),
                "replicated": sess._replicated,
            }
            agreed = self._agree(min_generation, info)
            if agreed is None:  # counted out (or not admitted yet): join as a joiner
                self.admitted, self.clean_step = False, None
                min_generation = sess.coord.generation()
                continue
            gen, roster, infos = agreed
            members = [m for m, _ in roster]
            rank, world = members.index(self.member), len(members)
            target, tier = self._target(infos, sess._disk_step() if gen == 0 else None)
            if gen == 0 and target is None:
                tier = "none"
            self._restore(target, tier, infos)
            self.admitted = True
            self.clean_step = sess.step
            if world < sess.env.min_world:
                self._members = set(members)
                self._wait_for_members(gen, rank, world)
                min_generation = gen + 1
                continue
            sess.group.resize(rank, world)
            try:
                sess.group.build(gen)
                sess._formed_group(sess.step, fresh=target is None)
            except ReplicaMismatchError:
                raise
            except Exception:
                if sess.coord.generation() == gen:
                    sess.coord.advance_generation(gen, "group formation failed")
                min_generation = gen + 1
                continue
            self._formed(gen, rank, world, target, tier, infos, time.perf_counter() - t0)
            return

    def _formed_before(self) -> bool:
        return bool(self.sess.store.range(self.keys.roster).kvs)

    def _restore(self, target: int | None, tier: str, infos: dict[int, dict[str, Any]]) -> None:
        sess = self.sess
        t = time.perf_counter()
        nbytes = 0
        snap = sess._ckpt.snapshots
        if target is None:
            sess.step = 0
            return
        if tier == "live" and self.clean_step == target:
            return  # a survivor at the join point: nothing to load
        self.clean_step = None
        if target in memory_steps(snap):
            nbytes, tier = restore_memory_step(snap, sess._state, target), "memory"
        elif tier in ("memory", "peer", "live"):
            nbytes, tier = self._restore_peer(target, infos), "peer"
        else:
            nbytes = sess._ckpt.restore(sess._state, step=target).bytes_read
        if self._received is not None and self._received.get("step") == target:
            tier = "transfer"  # a joiner: the state came from a survivor's memory
        if sess._part is not None and tier in ("peer", "disk"):
            sess._part.restore(target, tier)  # the own part over the peer's / rank 0's
        elif tier == "transfer":
            derive_rng(self.member, target)  # not the survivor's RNG stream
        sess.step = target
        if sess.events is not None:
            sess.events.emit(
                "restore", step=target, tier=tier, seconds=time.perf_counter() - t, bytes=nbytes
            )

    def _restore_peer(self, target: int, infos: dict[int, dict[str, Any]]) -> int:
        from stalwart.checkpoint import SnapshotConfig, Snapshotter

        host = socket.gethostname()
        for m, info in sorted(infos.items()):
            if target in info.get("steps", []) and info.get("host") == host:
                peer = Snapshotter(SnapshotConfig(self.names.rank(m)))
                return restore_memory_step(peer, self.sess._state, target)
        raise RuntimeError(f"no snapshot of step {target} reachable from member {self.member}")

    def _formed(
        self,
        gen: int,
        rank: int,
        world: int,
        target: int | None,
        tier: str,
        infos: dict[int, dict[str, Any]],
        seconds: float,
    ) -> None:
        sess = self.sess
        old = self.world
        sess.rank, sess.world_size, sess.generation = rank, world, gen
        if sess._genwatch is not None:  # etcd: "moved" means past this generation now
            sess._genwatch.follow(gen)
        self._members = set(infos)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        fields = self._apply_plan(rank, world)
        self.world = world
        sess._t_progress = time.time()
        if target is None:
            sess.acct.snapshot_now(0)
        if rank == 0 and sess.events is not None:
            if gen > 0:
                last = max(int(i.get("done", 0)) for i in infos.values())
                sess.events.emit(
                    "recovery_end",
                    strategy="elastic",
                    generation=gen,
                    restored_step=target or 0,
                    steps_lost=max(0, last - (target or 0)),
                    source_tier=tier,
                    ok=True,
                )
            if old and old != world:
                grow = self._grow or {}
                stall = time.perf_counter() - grow["t0"] if grow else seconds
                sess.events.emit(
                    "resize",
                    generation=gen,
                    from_world_size=old,
                    reason="grow" if world > old else "shrink",
                    step=target or 0,
                    stall_s=stall,
                    transfer_bytes=int(grow.get("bytes", 0)),
                    transfer_s=float(grow.get("seconds", 0.0)),
                    **fields,
                )
                word = "grew" if world > old else "shrank"
                print(
                    f"stalwart: generation {gen}: {word} {old} -> {world} workers at step "
                    f"{target or 0} ({fields.get('micro_batches', 1)} micro-batches/rank)",
                    file=sys.stderr,
                    flush=True,
                )
        self._grow = None
        self._watch(rank == 0)
        sess.acct.recovered(seconds)
        sess._publish("step")

    def _apply_plan(self, rank: int, world: int) -> dict[str, Any]:
        from stalwart.data import apply_plan, plan_batch

        sess = self.sess
        if self.batch is not None:
            plan = plan_batch(self.batch, world, min_world=sess.env.min_world)
            if rank < plan.world_size:
                return apply_plan(sess._state, plan, rank)
            return {"world_size": world, "micro_batches": plan.micro_batches}
        for obj in sess._state.values():  # no policy: reshard loaders, keep their batch
            reshard = getattr(obj, "reshard", None)
            if callable(reshard):
                reshard(world_size=world, rank=rank)
        return {"world_size": world, "micro_batches": 1}

    def _watch(self, leader: bool) -> None:
        if leader and self.watcher is None:
            snap = self.sess._ckpt.snapshots
            self.watcher = JoinWatcher(
                self.sess.store, self.keys, self.token, snap.directory, members=self._members
            )
        elif not leader and self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        if self.watcher is not None:
            self.watcher.members = set(self._members)

    def finished(self) -> None:
        """The group trained to the end: joiners still waiting exit."""
        if self.sess.rank == 0:
            self.sess.store.put(self.keys.finished, b"1")
        self.close()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
