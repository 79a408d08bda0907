"""The job's generation as this agent knows it: the one agent-side owner.

The coordinator holds the job's generation (every member sees the same number; a member
of an older one is fenced). The agent needs its own view of three numbers that change
together: the generation it last saw or made, how many whole-job restarts it did (a
worker's ``TORCHELASTIC_RESTART_COUNT``), and the ``MASTER_PORT`` its workers use (a
restart moves to a fresh one, as torchrun's does). They used to be fields of the agent
written from five modules; here they change only through :meth:`bump`, :meth:`follow`,
:meth:`restart` and :meth:`sync`. It works on the job's coordinator directly (the
cluster's, fenced by this node's lease: a bump after the lease is gone raises
``FencedError``, which ends the agent as fenced, agent/cluster/_cluster.py).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart.agent._types import EventSink
from stalwart.agent.cluster._follow import watch_wait
from stalwart.agent.cluster._genfeed import GenerationFeed
from stalwart.agent.cluster._relay import GenerationRelay
from stalwart.coordinator import Coordinator
from stalwart.logs import get_logger

__all__ = ["Feed", "JobGeneration", "LaunchRecord", "free_port"]

_log = get_logger(__name__)


class Feed(Protocol):
    """The newest generation a watch saw (agent/cluster/_genfeed.py); None: unknown."""

    def latest(self) -> int | None: ...

    def reason(self, generation: int) -> str | None:
        """Why ``generation`` was set, as the watch carried it (None: not known there)."""
        ...


class LaunchRecord(Protocol):
    """The job's launch record (agent/cluster/_cluster.py): where a restart's port is published."""

    def publish(self, key: str, record: dict[str, Any]) -> None: ...
    def read(self, key: str, timeout: float) -> dict[str, Any]: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Followed:
    """Another node moved the job to ``generation``; ``restart``: by a whole-job restart
    (this node restarts its workers too, on ``master_port``)."""

    generation: int
    restart: bool


class JobGeneration:
    def __init__(
        self, coord: Coordinator, launch: LaunchRecord, events: EventSink, world_size: int
    ) -> None:
        self._coord = coord
        self._launch = launch
        self._events = events
        self._world_size = world_size
        self._generation = 0
        self._restarts = 0
        self._master_port = free_port()
        self._feed: Feed | None = None
        self._relay: GenerationRelay | None = None

    def started(self, port: int) -> Callable[[], None]:
        """The job's first ``MASTER_PORT`` (:meth:`use_port`), and from now on the
        generation followed through a watch on the coordinator's store
        (agent/cluster/_genfeed.py) and told to this node's workers as the watch delivers
        it (agent/cluster/_relay.py: :attr:`relay_address`); returns what closes both."""
        self.use_port(port)
        coord = self._coord
        wait_s = watch_wait(coord.config.lease_ttl)
        try:
            self._relay = relay = GenerationRelay()
        except OSError as err:  # no local sockets here: each worker watches the store
            _log.warning("no generation relay for the workers (%s): each watches the store", err)
            relay = None
        publish = None if relay is None else relay.publish
        feed = GenerationFeed(
            lambda: coord.store, coord.generation_key, wait_s=wait_s, on_generation=publish
        )
        self.use_feed(feed)

        def close() -> None:
            feed.close()
            if relay is not None:
                relay.close()

        return close

    @property
    def relay_address(self) -> str:
        """Where this node's workers hear the generation (the contract's ``gen_relay``;
        "": nowhere, each watches the store)."""
        return "" if self._relay is None else self._relay.address

    def use_feed(self, feed: Feed) -> None:
        """Look at the generation through ``feed`` (agent/cluster/_genfeed.py: a watch) instead of
        a store read at every :meth:`follow`; the store is read when the feed says it moved
        or does not know."""
        self._feed = feed

    @property
    def current(self) -> int:
        return self._generation

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def master_port(self) -> int:
        return self._master_port

    def sync(self) -> int:
        """Take the coordinator's generation as ours (at the start; after an elastic
        member left, whose survivors may have bumped it themselves)."""
        self._generation = self._coord.generation()
        self._tell_workers()
        return self._generation

    def use_port(self, port: int) -> None:
        """The job's first ``MASTER_PORT``, as the launch record says (node 0 chose it)."""
        self._master_port = port

    def bump(self, reason: str, *, must_win: bool = False) -> int:
        """Advance the generation; ``must_win``: until our own bump (with our reason) is
        the current one, even if a worker bumped first (a restart must be recognisable
        as one by the other agents, which read the reason)."""
        change = self._coord.advance_generation(self._generation, reason)
        while must_win and not change.won:
            change = self._coord.advance_generation(change.generation, reason)
        self._generation = int(change.generation)
        self._tell_workers()
        self._events.emit(
            "generation", generation=self._generation, world_size=self._world_size, reason=reason
        )
        return self._generation

    def restart(self, what: str, *, world_size: int | None = None) -> int:
        """A whole-job restart this node starts: a fresh port, a bump every node can
        recognise (its reason starts with "restart"), the port published under it;
        ``world_size``: the restarted job's (a sharded elastic resize), else as before."""
        if world_size is not None:
            self._world_size = world_size
        self._master_port = free_port()
        self.bump(f"restart after {what}", must_win=True)
        self._launch.publish(f"master-{self._generation}", {"port": self._master_port})
        return self._generation

    def restarted(self) -> None:
        """This node's workers were started again (the restart count they see)."""
        self._restarts += 1

    def follow(self) -> Followed | None:
        """Another node bumped the generation (None: nobody did). When it was for a
        restart, this node's workers restart too, on the port published for it."""
        feed = self._feed
        if self._relay is not None:
            self._relay.tend()  # workers connected since: they hear the next bump
        seen = feed.latest() if feed is not None else None
        if seen is not None and seen <= self._generation:
            return None  # the watch saw no bump: no store read
        why = feed.reason(seen) if feed is not None and seen is not None else None
        if seen is not None and why is not None:
            gen = seen  # the bump's number and reason, from its watch event: no read
        else:
            gen = self._coord.generation()
            if gen <= self._generation:
                return None
            why = str(self._coord.generation_meta().get("reason", ""))
        self._generation = gen
        self._tell_workers()  # (the feed told them already, unless it did not know)
        return Followed(gen, why.startswith("restart"))

    def _tell_workers(self) -> None:
        if self._relay is not None:
            self._relay.publish(self._generation)

    def follow_port(self) -> None:
        """The port of the restart we followed (:meth:`follow`)."""
        self._master_port = int(self._launch.read(f"master-{self._generation}", 30)["port"])
