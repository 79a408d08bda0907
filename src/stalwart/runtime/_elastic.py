"""``--strategy elastic`` in the worker: shrink on a failure, grow on a join, no restarts.

A *member* is named for life by the rank it was launched with (``RANK`` at start; its
snapshot namespace ``<job>-r<member>``) plus an *incarnation* (one per process the agent
starts for it). Each generation has a *roster*, decided once in the store
(``el/roster/<gen>``, create-if-absent): the previous roster's members that are still
alive (the agents keep ``el/alive/<member>`` = incarnation) plus the joiners admitted
into that generation. Ranks are the roster's order, dense from 0; the world size is its
length.

Shrink: a survivor whose step failed bumps the generation (as under ``flash``) and the
survivors agree on the newest step they all hold in memory (the agents drop the dead
member from ``el/alive`` within the crash-detection latency), restore it, renumber,
rebuild the group and go on: nobody waits for a replacement. Grow: see
:mod:`stalwart.runtime._joiners`; the survivors stop at one step boundary, where their
live state *is* the join point (no restore), for a snapshot, the second transfer and the
group's re-formation. After every formation the batch plan (``Session.use_batch``) is
recomputed and applied (loader resharded, micro-batches, LR scale) and rank 0 writes a
``resize`` event when the world size changed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from stalwart.coordinator.store import Compare, Delete, Put
from stalwart.errors import StalwartError
from stalwart.runtime._joiners import (
    JoinRequest,
    JoinWatcher,
    Keys,
    alive_members,
    decode_admit,
    newest_digest,
    slot_digest,
)
from stalwart.runtime._live import LiveRollback
from stalwart.runtime._memory import memory_steps, restore_memory_step
from stalwart.runtime._rendezvous import choose

if TYPE_CHECKING:
    from stalwart.data import BatchConfig
    from stalwart.runtime.session import Session

__all__ = ["Elastic", "ElasticWaitError", "use_batch"]

_POLL_S = 0.003


class ElasticWaitError(StalwartError):
    """The job has fewer members than its minimum and none joined in time."""


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


Roster = list[tuple[int, str]]


class Elastic:
    def __init__(self, sess: Session) -> None:
        from stalwart.coordinator.token import read_token_file

        self.sess = sess
        env = sess.env
        self.member = env.rank  # the launch rank names the member for life
        self.inc = env.incarnation or "0"
        self.keys = Keys(env.job)
        self.token = read_token_file(env.token_file)
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
        """After ``Session.track``: guard schedulers, prepare live rollback."""
        self.live = LiveRollback(state, lambda: self.sess.group.error is not None)

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

    # ------------------------------------------------------------ store helpers
    def _roster(self, gen: int) -> Roster | None:
        kv = self.sess.store.get(self.keys.gen(self.keys.roster, gen))
        return None if kv is None else [(int(m), str(i)) for m, i in json.loads(kv.value)]

    def _previous_roster(self, gen: int) -> Roster | None:
        best: tuple[int, bytes] | None = None
        for kv in self.sess.store.range(self.keys.roster).kvs:
            g = int(kv.key.rsplit("/", 1)[1])
            if g < gen and (best is None or g > best[0]):
                best = (g, kv.value)
        return None if best is None else [(int(m), str(i)) for m, i in json.loads(best[1])]

    def _expected(self, gen: int) -> tuple[Roster, int]:
        """Who must take part in ``gen`` (and the least count: the launch size at the
        first formation, when every started member must be in)."""
        store, keys = self.sess.store, self.keys
        alive = alive_members(store, keys)
        prev = self._previous_roster(gen)
        if prev is None:
            return sorted(alive.items()), self.sess.env.world_size
        out = {(m, i) for m, i in prev if alive.get(m) == i}
        kv = store.get(keys.gen(keys.admit, gen))
        admit = decode_admit(None if kv is None else kv.value)
        out |= {k for k in admit if alive.get(k[0]) == k[1]}
        return sorted(out), 0

    # ------------------------------------------------------------ agreement
    def _agree(
        self, min_generation: int, info: dict[str, Any]
    ) -> tuple[int, Roster, dict[int, dict[str, Any]]] | None:
        """Publish ``info`` in the current generation and wait for its roster; None if
        this process is not in it (a joiner not yet admitted)."""
        sess, keys, me = self.sess, self.keys, (self.member, self.inc)
        deadline = time.monotonic() + sess.env.hang_ceiling_s
        while True:
            gen = sess.coord.generation()
            if gen < min_generation:
                sess.coord.advance_generation(gen, "a member saw a collective fail")
                continue
            prefix = keys.gen(keys.info, gen) + "/"
            published = False
            while True:
                roster = self._roster(gen)
                if roster is not None:
                    if me not in roster:
                        return None
                    infos = {
                        int(kv.key.rsplit("/", 1)[1]): json.loads(kv.value)
                        for kv in sess.store.range(prefix).kvs
                    }
                    return gen, roster, {m: infos[m] for m, _ in roster}
                expected, least = self._expected(gen)
                if me not in expected:
                    return None
                if not published:
                    sess.store.put(keys.member(prefix, self.member), json.dumps(info).encode())
                    published = True
                have = {
                    int(kv.key.rsplit("/", 1)[1]): json.loads(kv.value)
                    for kv in sess.store.range(prefix).kvs
                }
                if len(expected) >= least and all(
                    have.get(m, {}).get("inc") == i for m, i in expected
                ):
                    key = keys.gen(keys.roster, gen)
                    doc = json.dumps([[m, i] for m, i in expected]).encode()
                    sess.store.txn([Compare(key, "mod_revision", "==", 0)], [Put(key, doc)])
                    continue  # read back the roster that won
                if sess.coord.generation() != gen:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"generation {gen}: {len(have)} of {len(expected)} members arrived "
                        f"within {sess.env.hang_ceiling_s:.0f}s"
                    )
                time.sleep(_POLL_S)

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
                peer = Snapshotter(SnapshotConfig(f"{self.sess.env.job}-r{m}"))
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

    # ------------------------------------------------------------ growing
    def grow(self, step: int, *, need: int = 0) -> None:
        """Stop at the boundary after ``step``: rank 0 admits the prefetched joiners
        (``need``: wait until that many are ready, below MIN) into the next generation."""
        sess = self.sess
        gen = sess.generation
        sess._publish("recovering")
        sess.acct.flush()
        if sess.rank == 0:
            self._admit(gen, step, need)
        else:
            self._wait_generation(gen, sess.env.hang_ceiling_s)
        self.join(gen + 1)

    def _admit(self, gen: int, step: int, need: int) -> None:
        sess = self.sess
        t0 = time.perf_counter()
        if self.watcher is None:
            self._watch(True)
        assert self.watcher is not None
        snap = sess._ckpt.snapshots
        latest = snap.latest()
        if latest is None or latest.step != step:
            snap.snapshot(sess._state, step, blocking=True)
        deadline = time.monotonic() + sess.env.elastic_wait_s
        ready: list[JoinRequest] = []
        while True:
            ready += self.watcher.take_ready()
            if len(ready) >= need:
                break
            if time.monotonic() > deadline:
                msg = (
                    f"elastic job has {sess.world_size} members, fewer than its minimum "
                    f"{sess.env.min_world}, and no member joined within "
                    f"{sess.env.elastic_wait_s:.0f}s; start more nodes or lower MIN in "
                    "--nnodes/--nproc-per-node MIN:MAX"
                )
                sess.store.put(self.keys.failed, msg.encode())
                raise ElasticWaitError(msg)
            time.sleep(0.02)
        found = newest_digest(snap.directory)
        assert found is not None
        _, sent_step, digest = found
        admitted: list[dict[str, Any]] = []
        sent: list[JoinRequest] = []
        nbytes, secs = 0, 0.0
        for req in ready:
            try:
                result = self.watcher.send(req)  # the current step, into faulted pages
            except Exception:
                self.watcher.forget(req)
                continue
            nbytes, secs = nbytes + result.nbytes, secs + result.seconds
            sent.append(req)
            admitted.append(
                {"member": req.member, "inc": req.inc, "step": sent_step, "digest": digest}
            )
        keys = self.keys
        doc = json.dumps(admitted).encode()
        ops: list[Put | Delete] = [Put(keys.gen(keys.admit, gen + 1), doc)]
        ops += [Delete(keys.member(keys.join, r.member)) for r in sent]
        reason = f"grow: member(s) {', '.join(str(a['member']) for a in admitted)} joining"
        change = sess.coord.advance_generation(gen, reason, also=ops)
        if not change.won:
            for req in ready:
                self.watcher.forget(req)
        self._grow = {"bytes": nbytes, "seconds": secs, "t0": t0}

    def _wait_generation(self, gen: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s + 30.0  # rank 0 gives up first, and says why
        while self.sess.coord.generation() == gen:
            kv = self.sess.store.get(self.keys.failed)
            if kv is not None:
                raise ElasticWaitError(kv.value.decode())
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {gen} did not move on within {timeout_s:.0f}s")
            time.sleep(_POLL_S)

    def _wait_for_members(self, gen: int, rank: int, world: int) -> None:
        sess = self.sess
        need = sess.env.min_world
        if rank == 0 and sess.events is not None:
            sess.events.emit("waiting", have=world, need=need, reason="below the minimum world")
        print(
            f"stalwart: {world} member(s) left, the job needs at least {need}: waiting up to "
            f"{sess.env.elastic_wait_s:.0f}s for members to join",
            file=sys.stderr,
            flush=True,
        )
        sess.rank, sess.world_size, sess.generation = rank, world, gen
        if rank == 0:
            self._admit(gen, sess.step, need - world)
        else:
            self._wait_generation(gen, sess.env.elastic_wait_s)

    def _await_admission(self) -> int:
        """A joiner: ask for the state and wait until a survivor admits this member;
        returns the generation it was admitted into."""
        from stalwart.transfer import SlotReceiver

        sess, keys = self.sess, self.keys
        snap = sess._ckpt.snapshots
        deadline = time.monotonic() + sess.env.elastic_wait_s
        t0 = time.perf_counter()
        with SlotReceiver(self.token) as rx:
            host, port = rx.start()
            req = JoinRequest(self.member, self.inc, host, port, snap.config.namespace)
            key = keys.member(keys.join, self.member)
            sess.store.put(key, req.encode())
            polls, prepared = 0, False
            while True:
                gen = sess.coord.generation()
                kv = sess.store.get(keys.gen(keys.admit, gen))
                mine = decode_admit(None if kv is None else kv.value).get((self.member, self.inc))
                if mine is not None:
                    break
                if sess.store.get(keys.finished) is not None:
                    sess.close()
                    print(
                        f"stalwart: member {self.member}: the job finished before it was "
                        "admitted; exiting",
                        file=sys.stderr,
                        flush=True,
                    )
                    raise SystemExit(0)
                polls += 1
                first = next((r for r in rx.results() if r.ok), None)
                if first is not None and not prepared:
                    # the prefetch told the size: fault in the other slot now, so that
                    # the transfer at the step boundary (the survivors' stall) is warm
                    rx.prepare(snap.config.namespace, first.nbytes)
                    prepared = True
                if polls % 20 == 0 and sess.store.get(key) is None:
                    # admitted into a generation that a failure overtook: ask again
                    req = JoinRequest(
                        req.member, req.inc, req.host, req.port, req.namespace, req.attempt + 1
                    )
                    sess.store.put(key, req.encode())
                if time.monotonic() > deadline:
                    raise ElasticWaitError(
                        f"member {self.member} was not admitted within "
                        f"{sess.env.elastic_wait_s:.0f}s: no survivor served its join request"
                    )
                time.sleep(0.01)
            results = [r for r in rx.results() if r.ok]
            sess.store.delete(key)  # a request put again meanwhile must not be served
        snap.reload()
        got = [r for r in results if r.step == mine["step"]]
        if not got or got[-1].slot is None:
            raise ElasticWaitError(f"member {self.member}: the admitted state never arrived")
        step, digest = slot_digest(snap.directory, got[-1].slot)
        if digest != mine["digest"]:
            raise ElasticWaitError(
                f"member {self.member}: received state of step {step} has xxh3 {digest}, the "
                f"survivor sent {mine['digest']}; refusing to train on it"
            )
        self._received = {"step": step, "digest": digest, "seconds": time.perf_counter() - t0}
        if sess.events is not None:
            sess.events.emit(
                "state_received",
                step=step,
                digest=digest,
                sender_digest=str(mine["digest"]),
                bytes=sum(r.nbytes for r in results),
                seconds=sum(r.seconds for r in results),
                transfers=len(results),
            )
        return int(gen)

    def finished(self) -> None:
        """The group trained to the end: joiners still waiting exit."""
        if self.sess.rank == 0:
            self.sess.store.put(self.keys.finished, b"1")
        self.close()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
