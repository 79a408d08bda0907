"""The degraded-link detector (agent/detection/_detectors.py composes it with the others): the
board's step and compute times, judged by agent/detection/degraded.py, become a ``link_degraded``
event and one line (then ``link_recovered`` and a line); under ``--on-degraded evict``
the node that holds rank 0 revokes the far node's lease, which is then recovered as any
lost node's (agent/detection/_dataplane_watch.py's ``revoke_node``: the same path as a cut data
plane).

Each window's verdict is published under ``link-n<node>`` (one store write per window,
as the straggler exchange): the link is declared only when no other live node's
fresh verdict says otherwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from stalwart.agent._types import EventSink, Say
from stalwart.agent.detection.degraded import (
    DegradedAction,
    DegradedConfig,
    LinkWindow,
    LinkWindows,
    agreed,
)
from stalwart.agent.processes._workers import LocalWorkers
from stalwart.errors import StalwartError

__all__ = ["LinkDetector"]


class Records(Protocol):
    """The job's launch records in the coordinator store (agent/cluster/_cluster.py)."""

    def publish(self, key: str, record: dict[str, Any]) -> None: ...
    def published(self, key: str) -> dict[str, Any] | None: ...


Evict = Callable[[int, str, float], None]
"""Revoke node N's lease: (node, why, when the fault began)."""


class LinkDetector:
    """One per agent of a job of several nodes."""

    def __init__(
        self,
        *,
        config: DegradedConfig,
        node: int,
        workers: LocalWorkers,
        records: Records,
        live: Callable[[], set[int]],
        holder: Callable[[set[int]], int],
        evict: Evict | None,
        events: EventSink,
        say: Say,
    ) -> None:
        """``live``: the live member nodes; ``holder``: the node holding rank 0 among
        them; ``evict``: None where this node cannot revoke leases (no peer watch)."""
        self.windows = LinkWindows(config)
        self._cfg, self._node, self._workers, self._records = config, node, workers, records
        self._live, self._holder, self._evict = live, holder, evict
        self._events, self._say = events, say
        self.degraded: LinkWindow | None = None  # the first window of the declared episode
        self._peers: list[int] = []

    def check(self, now: float) -> None:
        """One look per loop turn (``now``: wall clock)."""
        slots = self._workers.judged()
        window = self.windows.observe(slots, now)
        if window is None:
            return
        live = self._publish(window)
        if self.degraded is not None:
            if self.windows.recovered(window):
                self._recovered(window)
            return
        if live is None or not self.windows.persisting():
            return
        peers = sorted(live - {self._node})
        records = {n: self._read(n) for n in peers}
        generation = window.generation
        first = self.windows.first
        if peers and first is not None and agreed(records, generation, now, self._cfg.window_s):
            self._declare(now, first, window, peers, live)

    def _publish(self, window: LinkWindow) -> set[int] | None:
        """This window's verdict for the others; the live nodes (None: the store is slow
        or away, so nobody can be told or asked: this window is not judged)."""
        try:
            self._records.publish(f"link-n{self._node}", window.record())
            return self._live() | {self._node}
        except (StalwartError, OSError, ValueError):
            return None

    def _read(self, node: int) -> dict[str, Any] | None:
        try:
            return self._records.published(f"link-n{node}")
        except (StalwartError, OSError, ValueError):
            return None

    def _declare(
        self, now: float, first: LinkWindow, last: LinkWindow, peers: list[int], live: set[int]
    ) -> None:
        self.degraded, self._peers = first, peers
        evict = self._cfg.action is DegradedAction.EVICT
        holder = self._holder(live)
        acts = evict and self._evict is not None and holder == self._node and len(peers) == 1
        where = (
            f"the link between node {self._node} and node {peers[0]}"
            if len(peers) == 1
            else f"a link among nodes {sorted(live)} (which one cannot be told from step times)"
        )
        how = (
            f"{where} is degraded: steps take {last.step_s:.2f} s, {last.ratio:.1f}x the "
            f"median {last.median_step_s * 1000:.0f} ms, while the ranks compute "
            f"{last.compute_s * 1000:.0f} ms per step as before (median "
            f"{last.median_compute_s * 1000:.0f} ms) and wait in collectives "
            f"{last.wait_share:.0%} of the time"
        )
        latency = now - first.t_start
        action = "evict" if acts else "report"
        self._events.emit(
            "link_degraded",
            domain={"rank": None, "node": self._node},
            peers=peers,
            ratio=last.ratio,
            step_s=last.step_s,
            median_s=last.median_step_s,
            compute_ratio=(
                last.compute_s / last.median_compute_s if last.median_compute_s > 0 else 0.0
            ),
            wait_share=last.wait_share,
            since=first.t_start,
            latency_s=latency,
            action=action,
        )
        if acts:
            then = f"evicting node {peers[0]} (--on-degraded evict)"
        elif evict and holder != self._node:
            then = f"node {holder} (holding rank 0) decides the eviction"
        elif evict:
            then = "reported only: eviction needs the one node behind the link"
        else:
            then = "reported (--on-degraded evict drops the node behind it)"
        self._say(f"{how}; since {latency:.1f} s, {then}")
        if acts and self._evict is not None:
            self._evict(peers[0], f"link degraded ({last.ratio:.1f}x step time)", first.t_start)

    def _recovered(self, window: LinkWindow) -> None:
        first, self.degraded = self.degraded, None
        assert first is not None
        lasted = window.t_end - first.t_start
        self._events.emit(
            "link_recovered",
            domain={"rank": None, "node": self._node},
            peers=self._peers,
            ratio=window.ratio,
            step_s=window.step_s,
            median_s=window.median_step_s,
            degraded_s=lasted,
        )
        self._say(
            f"the link from node {self._node} to {self._peers} recovered: steps take "
            f"{window.step_s * 1000:.0f} ms again ({window.ratio:.1f}x the median), "
            f"after {lasted:.1f} s degraded"
        )
