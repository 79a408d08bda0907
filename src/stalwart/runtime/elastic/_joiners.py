"""Elastic joins: the store keys of an elastic job, a joiner's request, and the
survivor-side watcher that sends the current state to joiners while training goes on.

A joiner (a member started after the job formed: a restarted worker, a ``join`` fault,
a new node) starts a :class:`~stalwart.transfer.SlotReceiver` and puts a *join request*
(``el/join/<member>``: ``{"v": 1, "member", "inc", "host", "port", "namespace"}``). The
group's rank 0 runs a :class:`JoinWatcher` thread: it sends its newest complete snapshot
slot to every request of a live member (pinned, overlapped with training: the *prefetch*)
and then votes to stop at the next step boundary. There rank 0 snapshots the current
step, sends it again (the joiner's slot pages are faulted in by then, so this second
transfer runs at full speed), and admits the joiners into the next generation in the
same compare-and-swap that bumps it (``el/admit/<gen>``). Only the address and the
namespace travel through the store, never state.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from stalwart.checkpoint.format import checksum
from stalwart.checkpoint.slots import SlotFiles, latest_complete
from stalwart.coordinator.elastic_keys import Keys, alive_members
from stalwart.coordinator.store import Store
from stalwart.logs import get_logger
from stalwart.transfer import SendResult, TransferError, send_slot

__all__ = ["JoinRequest", "JoinWatcher", "Keys", "alive_members", "slot_digest"]

_log = get_logger(__name__)
_VERSION = 1


@dataclass(frozen=True)
class JoinRequest:
    member: int
    inc: str
    host: str
    port: int
    namespace: str
    attempt: int = 0  # a joiner asks again when it missed its admission (a failure followed)

    def encode(self) -> bytes:
        doc = {"v": _VERSION, **self.__dict__}
        return json.dumps(doc).encode()

    @staticmethod
    def decode(value: bytes) -> JoinRequest:
        d = json.loads(value)
        if not isinstance(d, dict) or d.get("v") != _VERSION:
            raise ValueError("not a version-1 join request")
        port = d["port"]
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError("port must be an integer in 1..65535")
        member, inc, host, ns = int(d["member"]), str(d["inc"]), str(d["host"]), str(d["namespace"])
        return JoinRequest(member, inc, host, port, ns, int(d.get("attempt", 0)))


def slot_digest(directory: str, slot: int) -> tuple[int, str]:
    """(step, xxh3-128 of the data) of a complete slot: what a joiner compares with the
    sender's to prove it holds the same bytes."""
    files = SlotFiles(directory, slot)
    meta = files.read_meta()
    if meta is None:
        raise TransferError(f"slot {slot} of {directory} is not complete")
    mm = files.map_readonly()
    try:
        with memoryview(mm) as view, view[: meta.data_size] as data:
            return meta.step, checksum(data)
    finally:
        mm.close()


def newest_digest(directory: str, slots: int = 2) -> tuple[int, int, str] | None:
    """(slot, step, digest) of the newest complete slot of ``directory``."""
    found = latest_complete(directory, slots)
    if found is None:
        return None
    step, digest = slot_digest(directory, found[0])
    return found[0], step, digest


class JoinWatcher:
    """Rank 0's background thread: prefetch the state to every live joiner."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        token: bytes,
        source_dir: str,
        *,
        members: set[int] | None = None,
        poll_s: float = 0.05,
        gather_s: float = 2.0,
    ) -> None:
        self.store, self.keys, self.token, self.source_dir = store, keys, token, source_dir
        self.poll_s = poll_s
        # members of the current group: any other live member is a joiner on its way, and
        # the watcher holds the ready ones back (up to gather_s) so that they join together
        self.members = set(members or ())
        self.gather_s = gather_s
        self._waiting = False
        self._t_ready: float | None = None
        self._lock = threading.Lock()
        self._ready: dict[tuple[int, str], JoinRequest] = {}
        self._sent: set[tuple[int, str, int]] = set()
        self.bytes_sent = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-joins", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._poll()
            except Exception as err:  # the store went away (end of job): stop quietly
                _log.debug("join watcher: %s", err)

    def _poll(self) -> None:
        requests = self.store.range(self.keys.join).kvs
        alive = alive_members(self.store, self.keys)
        with self._lock:
            joining = set(alive) - self.members - {m for m, _ in self._ready}
            self._waiting = bool(joining)
        if not requests:
            return
        done: dict[tuple[int, str, int], JoinRequest] = {}
        for kv in requests:
            try:
                req = JoinRequest.decode(kv.value)
            except (ValueError, KeyError, TypeError) as err:
                _log.warning("join request %s skipped: %s", kv.key, err)
                continue
            key = (req.member, req.inc, req.attempt)
            if alive.get(req.member) != req.inc or key in self._sent or self._stop.is_set():
                continue
            try:
                result = self.send(req)
            except TransferError as err:
                _log.warning("state for joining member %d not sent: %s", req.member, err)
                continue
            done[key] = req
            _log.debug("prefetched step %d to member %d", result.step, req.member)
        with self._lock:  # joiners that asked together are admitted together
            self._sent |= done.keys()
            self._ready.update({(r.member, r.inc): r for r in done.values()})
            if done and self._t_ready is None:
                self._t_ready = time.monotonic()
            joining = set(alive) - self.members - {m for m, _ in self._ready}
            self._waiting = bool(joining)

    def send(self, req: JoinRequest) -> SendResult:
        result = send_slot((req.host, req.port), self.token, self.source_dir, req.namespace)
        self.bytes_sent += result.nbytes
        self.seconds += result.seconds
        return result

    def has_ready(self) -> bool:
        """Joiners are prefetched and no other joiner is on its way (or the first ready
        one has waited ``gather_s`` for the others)."""
        with self._lock:
            if not self._ready:
                return False
            waited = time.monotonic() - (self._t_ready or 0.0)
            return not self._waiting or waited >= self.gather_s

    def take_ready(self) -> list[JoinRequest]:
        """The joiners prefetched so far (they are handed over once)."""
        with self._lock:
            out = list(self._ready.values())
            self._ready.clear()
            self._t_ready = None
            return out

    def forget(self, req: JoinRequest) -> None:
        """A joiner that was not admitted after all: prefetch it again next time."""
        with self._lock:
            self._sent.discard((req.member, req.inc, req.attempt))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def decode_admit(value: bytes | None) -> dict[tuple[int, str], dict[str, Any]]:
    """``el/admit/<gen>``: (member, inc) -> {"step", "digest"} of the state it was sent."""
    if value is None:
        return {}
    return {(int(d["member"]), str(d["inc"])): d for d in json.loads(value)}
