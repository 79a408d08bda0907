"""Background replication of snapshot slots to a buddy node (issue 7's peer replicas).

A :class:`Replicator` runs in the node agent: for each local slot directory (one per
local rank) it sends the newest complete snapshot to the buddy's :class:`SlotReceiver`
whenever its sequence number changed, one at a time, under one bandwidth cap for the
whole node (one :class:`Pacer` shared by every send), so that replication takes a
bounded share of the network and of the cores that training uses.

Why polling the slot metas (every ``poll_s``) rather than being told: the agent and the
workers are separate processes and the slot files are the interface between them
(checkpoint/slots.py); reading a few small JSON files per interval costs microseconds.
Why "newest only": a replica is useful only as the latest restorable state; sending a
snapshot that is already superseded would spend bandwidth on something never used.

Why one step for the whole node: a lost node's ranks are restored together, to a step
that all of them (and the survivors) hold. Each round sends, for every rank, the slot of
the newest step that *every* rank of the node holds complete. Sending each rank's own
newest instead let the ranks' replicas drift apart when a round was slower than the
snapshot interval (1 GB per node, 2 saturated cores: rank 2's replica held step 150,
rank 3's steps 50 and 200), and the recovery found no common step and restarted the job
from step 0. With one step per round, a round cut by the loss leaves every rank with the
previous round's step at least. (When the ranks share no step at all, say while they
take their first snapshots, each rank's newest is sent.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stalwart.logs import get_logger
from stalwart.transfer._wire import Pacer
from stalwart.transfer.errors import TransferError
from stalwart.transfer.sender import (
    SendConfig,
    SendResult,
    complete_steps,
    newest_of,
    send_slot,
)

__all__ = ["BEHIND_GRACE_S", "ReplicaConfig", "Replicator"]

_log = get_logger(__name__)

BEHIND_GRACE_S = 10.0  # how long copies may stay behind before the user is told


@dataclass(frozen=True)
class ReplicaConfig:
    """``rate_bytes_per_s`` caps the node's replication traffic (None: no cap)."""

    rate_bytes_per_s: float | None = 200e6
    poll_s: float = 0.2
    chunk_bytes: int = 16 << 20


@dataclass
class ReplicaStats:
    sent: dict[str, int] = field(default_factory=dict)  # buddy namespace -> last seq sent
    sent_step: dict[str, int] = field(default_factory=dict)  # ... and its step
    failures: int = 0
    last_error: str | None = None


class Replicator:
    """Keeps the buddy's copy of every ``sources`` slot directory up to date.

    ``sources`` maps the namespace to store under at the buddy (e.g.
    ``SlotNames.replica(rank)``) to the local slot directory. ``address`` is the buddy's
    receiver, or a callable returning it (the buddy may change after a membership
    change; return None while there is none).
    """

    def __init__(
        self,
        token: bytes,
        address: tuple[str, int] | Callable[[], tuple[str, int] | None],
        sources: dict[str, str],
        config: ReplicaConfig | None = None,
        on_behind: Callable[[str], None] | None = None,
    ) -> None:
        """``on_behind`` is told once (again only after it caught up) when a buddy's copy
        stayed out of the snapshots the rank keeps for ``BEHIND_GRACE_S`` (see
        :meth:`behind`)."""
        self.config = config or ReplicaConfig()
        self._on_behind = on_behind
        self._behind_since: float | None = None
        self._warned = False
        self._token = token
        self._address = address
        self._sources = dict(sources)
        self.stats = ReplicaStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        rate = self.config.rate_bytes_per_s
        self._pacer = Pacer(rate, sleep=self._paced_sleep) if rate is not None else None

    def _paced_sleep(self, seconds: float) -> None:
        # a capped transfer spends most of its time here: close() cuts it short (the
        # receiver then publishes nothing, its previous copy stays)
        if self._stop.wait(seconds):
            raise TransferError("replication stopped")

    def set_sources(self, sources: dict[str, str]) -> None:
        """Replace what is replicated (e.g. a node adopted another node's ranks)."""
        self._sources = dict(sources)

    def forget_sent(self) -> None:
        """Send everything again at the next sync (e.g. the buddy changed)."""
        self.stats.sent.clear()
        self.stats.sent_step.clear()

    def round_step(self) -> int | None:
        """The step this round sends: the newest one that every source holds complete
        (None: they share none; each source's newest is sent)."""
        held: list[set[int]] = []
        for directory in self._sources.values():
            try:
                held.append(complete_steps(directory))
            except TransferError:
                return None  # a source without slots yet
        common = set.intersection(*held) if held else set()
        return max(common) if common else None

    def sync_once(self) -> list[SendResult]:
        """Send every source's slot of this round's step (see :meth:`round_step`) that
        the buddy does not have."""
        address = self._address() if callable(self._address) else self._address
        if address is None:
            return []
        cfg = SendConfig(chunk_bytes=self.config.chunk_bytes)
        step = self.round_step()
        out = []
        for namespace, directory in self._sources.items():
            if self._stop.is_set():
                break
            try:
                found = newest_of(directory, step)
            except TransferError:
                continue  # no slots yet
            if found is None or self.stats.sent.get(namespace) == found[1].seq:
                continue
            try:
                res = send_slot(
                    address,
                    self._token,
                    directory,
                    namespace,
                    config=cfg,
                    pacer=self._pacer,
                    step=step,
                )
            except TransferError as err:
                if self._stop.is_set():
                    break
                self.stats.failures += 1
                self.stats.last_error = str(err)
                _log.warning("replica of %s to %s:%d failed: %s", namespace, *address, err)
                continue
            self.stats.sent[namespace] = res.seq
            self.stats.sent_step[namespace] = res.step
            out.append(res)
        return out

    def check_behind(self, now: float) -> None:
        """Tell ``on_behind`` once when the copies stayed behind for ``BEHIND_GRACE_S``
        (again after a catch-up). Not at once: the first rounds of a job (slots being
        allocated) and a round cut short by a snapshot are behind for a moment; a
        replication that cannot keep up stays behind."""
        if self._on_behind is None:
            return
        why = self.behind()
        if why is None:
            self._behind_since, self._warned = None, False
            return
        if self._behind_since is None:
            self._behind_since = now
        if not self._warned and now - self._behind_since >= BEHIND_GRACE_S:
            self._on_behind(why)
            self._warned = True

    def behind(self) -> str | None:
        """Why the buddy's copies no longer help a recovery, or None. A replica restores
        a lost node only to a step the survivors still hold, and every rank keeps its
        two newest snapshots: a replica older than both (rounds slower than the snapshot
        interval) is useless, and the recovery goes to disk or restarts the job."""
        for namespace, directory in self._sources.items():
            sent = self.stats.sent_step.get(namespace)
            try:
                held = complete_steps(directory)
            except TransferError:
                continue
            if sent is not None and held and sent < min(held):
                return (
                    f"replication is behind: the buddy's copy of {namespace} is step {sent}, "
                    f"older than every snapshot the rank keeps ({sorted(held)}), so a node "
                    "loss now restores from disk or restarts the job; raise --replica-rate "
                    "or --snapshot-every"
                )
        return None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stalwart-replicate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            failures = self.stats.failures
            self.sync_once()
            self.check_behind(time.monotonic())
            # a buddy that stopped answering (lost, restarting): retry once a second
            failed = self.stats.failures != failures
            self._stop.wait(max(self.config.poll_s, 1.0) if failed else self.config.poll_s)

    def close(self) -> None:
        """Stop (a capped transfer in flight is cut at its next pause) and join."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
