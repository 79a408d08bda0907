"""The admission of joiners into an elastic job (docs/elastic.md, "Grow"): one part of
:class:`~stalwart.runtime.elastic._rejoin.ElasticRejoin`, beside the roster
(runtime/elastic/_roster.py).

On the survivors' side, rank 0 owns the :class:`~stalwart.runtime.elastic._joiners.JoinWatcher`
(the prefetch of the state to every joiner while training goes on); at a step boundary
it snapshots the current step, sends it again and admits the joiners into the next
generation in the compare-and-swap that bumps it. On the joiner's side, a process asks
for the state, waits for its admission and checks that the bytes it received are the
ones the survivor sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stalwart.coordinator.store import Delete, Put
from stalwart.logs import get_logger
from stalwart.runtime.elastic._joiners import (
    JoinRequest,
    JoinWatcher,
    Keys,
    decode_admit,
    newest_digest,
    slot_digest,
)
from stalwart.runtime.elastic._roster import POLL_S, ElasticWaitError

if TYPE_CHECKING:
    from stalwart.contract.env import WorkerEnv
    from stalwart.coordinator import Coordinator, Store
    from stalwart.metrics.events import EventLog
    from stalwart.runtime.state._tracking import TrackedState
    from stalwart.transfer import SlotReceiver

__all__ = ["JoinAdmission"]

_log = get_logger(__name__)


class JoinAdmission:
    def __init__(
        self,
        store: Store,
        coord: Coordinator,
        env: WorkerEnv,
        keys: Keys,
        member: tuple[int, str],
        token: bytes,
        tracked: TrackedState,
        events: EventLog | None,
        on_finished: Callable[[], None],
    ) -> None:
        self.store, self.coord, self.env, self.keys = store, coord, env, keys
        self.member, self.inc = member
        self.token, self.tracked, self.events = token, tracked, events
        self.on_finished = on_finished  # the job ended before this joiner got in
        self.watcher: JoinWatcher | None = None
        self.grow: dict[str, Any] | None = None  # the resize in progress (rank 0)
        self.received: dict[str, Any] | None = None  # what this joiner was sent

    # ------------------------------------------------------------ the survivors' side
    def watch(self, leader: bool, members: set[int]) -> None:
        """Rank 0 runs the watcher (``members``: the current group's), others none."""
        if leader and self.watcher is None:
            self.watcher = JoinWatcher(
                self.store,
                self.keys,
                self.token,
                self.tracked.snapshots.directory,
                members=members,
            )
        elif not leader and self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        if self.watcher is not None:
            self.watcher.members = set(members)

    def has_ready(self) -> bool:
        return self.watcher is not None and self.watcher.has_ready()

    def take_grow(self) -> dict[str, Any]:
        """The resize just formed: its transfer figures (empty for a shrink)."""
        grow, self.grow = self.grow, None
        return grow or {}

    def admit(self, gen: int, step: int, need: int, world: int, members: set[int]) -> None:
        """Rank 0 at the boundary after ``step``: admit the prefetched joiners into the
        next generation (``need``: wait until that many are ready, below MIN)."""
        t0 = time.perf_counter()
        if self.watcher is None:
            self.watch(True, members)
        watcher = self.watcher
        assert watcher is not None
        snap = self.tracked.snapshots
        latest = snap.latest()
        if latest is None or latest.step != step:
            snap.snapshot(self.tracked.state, step, blocking=True)
        ready = self._gather(watcher, need, world)
        found = newest_digest(snap.directory, snap.config.slots)
        assert found is not None
        _, sent_step, digest = found
        admitted: list[dict[str, Any]] = []
        sent: list[JoinRequest] = []
        nbytes, secs = 0, 0.0
        for req in ready:
            try:
                result = watcher.send(req)  # the current step, into faulted pages
            except Exception:
                watcher.forget(req)
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
        change = self.coord.advance_generation(gen, reason, also=ops)
        if not change.won:
            for req in ready:
                watcher.forget(req)
        self.grow = {"bytes": nbytes, "seconds": secs, "t0": t0}

    def _gather(self, watcher: JoinWatcher, need: int, world: int) -> list[JoinRequest]:
        deadline = time.monotonic() + self.env.elastic_wait_s
        ready: list[JoinRequest] = []
        while True:
            ready += watcher.take_ready()
            if len(ready) >= need:
                return ready
            if time.monotonic() > deadline:
                msg = (
                    f"elastic job has {world} members, fewer than its minimum "
                    f"{self.env.min_world}, and no member joined within "
                    f"{self.env.elastic_wait_s:.0f}s; start more nodes or lower MIN in "
                    "--nnodes/--nproc-per-node MIN:MAX"
                )
                self.store.put(self.keys.failed, msg.encode())
                raise ElasticWaitError(msg)
            time.sleep(0.02)

    def wait_generation(self, gen: int, timeout_s: float) -> None:
        """Not rank 0: wait for rank 0 to end ``gen`` (or to say why it could not)."""
        deadline = time.monotonic() + timeout_s + 30.0  # rank 0 gives up first, and says why
        while self.coord.generation() == gen:
            kv = self.store.get(self.keys.failed)
            if kv is not None:
                raise ElasticWaitError(kv.value.decode())
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {gen} did not move on within {timeout_s:.0f}s")
            time.sleep(POLL_S)

    # ------------------------------------------------------------ the joiner's side
    def await_admission(self) -> int:
        """A joiner: ask for the state and wait until a survivor admits this member;
        returns the generation it was admitted into."""
        from stalwart.transfer import SlotReceiver

        snap = self.tracked.snapshots
        t0 = time.perf_counter()
        with SlotReceiver(self.token) as rx:
            gen, mine = self._wait_admitted(rx)
            results = [r for r in rx.results() if r.ok]
            # a request put again meanwhile must not be served
            self.store.delete(self.keys.member(self.keys.join, self.member))
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
        self.received = {"step": step, "digest": digest, "seconds": time.perf_counter() - t0}
        if self.events is not None:
            self.events.emit(
                "state_received",
                step=step,
                digest=digest,
                sender_digest=str(mine["digest"]),
                bytes=sum(r.nbytes for r in results),
                seconds=sum(r.seconds for r in results),
                transfers=len(results),
            )
        return int(gen)

    def _wait_admitted(self, rx: SlotReceiver) -> tuple[int, dict[str, Any]]:
        """Put the join request and poll until this incarnation is admitted."""
        keys, store = self.keys, self.store
        snap = self.tracked.snapshots
        deadline = time.monotonic() + self.env.elastic_wait_s
        host, port = rx.start()
        req = JoinRequest(self.member, self.inc, host, port, snap.config.namespace)
        key = keys.member(keys.join, self.member)
        store.put(key, req.encode())
        polls, prepared = 0, False
        while True:
            gen = self.coord.generation()
            kv = store.get(keys.gen(keys.admit, gen))
            mine = decode_admit(None if kv is None else kv.value).get((self.member, self.inc))
            if mine is not None:
                return gen, mine
            if store.get(keys.finished) is not None:
                self._finished_first()
            polls += 1
            first = next((r for r in rx.results() if r.ok), None)
            if first is not None and not prepared:
                # the prefetch told the size: fault in the other slot now, so that
                # the transfer at the step boundary (the survivors' stall) is warm
                rx.prepare(snap.config.namespace, first.nbytes)
                prepared = True
            if polls % 20 == 0 and store.get(key) is None:
                # admitted into a generation that a failure overtook: ask again
                req = JoinRequest(
                    req.member, req.inc, req.host, req.port, req.namespace, req.attempt + 1
                )
                store.put(key, req.encode())
            if time.monotonic() > deadline:
                raise ElasticWaitError(
                    f"member {self.member} was not admitted within "
                    f"{self.env.elastic_wait_s:.0f}s: no survivor served its join request"
                )
            time.sleep(0.01)

    def _finished_first(self) -> None:
        self.on_finished()
        _log.info("member %d: the job finished before it was admitted; exiting", self.member)
        raise SystemExit(0)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
