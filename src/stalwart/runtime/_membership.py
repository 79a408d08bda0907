"""Membership of an elastic job: the roster of each generation and the admission of
joiners (docs/elastic.md, "Membership" and "Grow"). :class:`Membership` is the base of
:class:`stalwart.runtime._elastic.Elastic`, which adds joining, restoring and the step
hooks.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from stalwart.coordinator.store import Compare, Delete, Put
from stalwart.errors import FencedError, StalwartError
from stalwart.runtime._coord import fence_compares
from stalwart.runtime._joiners import (
    JoinRequest,
    JoinWatcher,
    Keys,
    alive_members,
    decode_admit,
    newest_digest,
    slot_digest,
)

if TYPE_CHECKING:
    from stalwart.runtime.session import Session

__all__ = ["ElasticWaitError", "Membership", "Roster"]

_POLL_S = 0.003

Roster = list[tuple[int, str]]


class ElasticWaitError(StalwartError):
    """The job has fewer members than its minimum and none joined in time."""


class Membership:
    """Roster agreement and admission; the state lives in :class:`Elastic`."""

    sess: Session
    keys: Keys
    member: int
    inc: str
    token: bytes
    watcher: JoinWatcher | None
    clean_step: int | None
    _grow: dict[str, Any] | None
    _received: dict[str, Any] | None
    _members: set[int]

    def join(self, min_generation: int) -> None:
        raise NotImplementedError

    def _watch(self, leader: bool) -> None:
        raise NotImplementedError

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
                    arrive = Put(keys.member(prefix, self.member), json.dumps(info).encode())
                    if not sess.store.txn(fence_compares(sess.env), [arrive]).succeeded:
                        raise FencedError(
                            f"member {self.member}: this node's agent lost its lease (it was "
                            "unresponsive for longer than --node-lease), so this worker stops "
                            f"instead of joining generation {gen}"
                        )
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
