"""The straggler detector (agent/_detectors.py composes it with the others): the board's
compute times, scored by agent/straggler.py, become a typed
:class:`~stalwart.agent.incidents.Straggler` with its ``fault_detected`` and ``straggler``
records; under ``--on-straggler evict`` it ends the rank's process."""

from __future__ import annotations

from typing import Protocol

from stalwart.agent._types import EventSink, Say
from stalwart.agent._workers import LocalWorkers
from stalwart.agent.incidents import Straggler
from stalwart.agent.straggler import (
    Declared,
    PeerMedians,
    StragglerAction,
    StragglerConfig,
    StragglerWindows,
)
from stalwart.chaos import FaultLedger

__all__ = ["StragglerDetector"]


class Killed(Protocol):
    """Where the agent notes why it killed a process (HangWatch.killed): the failure's
    error line."""

    killed: dict[int, str]


class StragglerDetector:
    """The board's compute times -> :class:`Straggler` (agent/straggler.py decides);
    writes ``fault_detected`` (fault ``straggler``) and the ``straggler`` event."""

    def __init__(
        self,
        *,
        config: StragglerConfig,
        node: int,
        workers: LocalWorkers,
        watch: Killed,
        ledger: FaultLedger,
        events: EventSink,
        say: Say,
        peers: PeerMedians | None = None,
    ) -> None:
        self._node, self._workers, self._watch, self._peers = node, workers, watch, peers
        self._ledger, self._events, self._say = ledger, events, say
        self.windows = StragglerWindows(config)
        self._evict = config.action is StragglerAction.EVICT

    def check(self, now: float) -> list[Straggler]:
        declared = self.windows.observe(self._workers.judged(), now, self._peers)
        return [self._report(d, now) for d in declared]

    def _report(self, d: Declared, now: float) -> Straggler:
        sc, domain = d.score, {"rank": d.score.rank, "node": self._node}
        fired = self._ledger.fired_at(pid=d.pid)
        latency = now - (fired if fired is not None else d.t_first)
        seen = (
            f"{d.windows} windows in a row"
            if d.windows == d.of
            else (f"{d.windows} of its last {d.of} windows")
        )
        how = (
            f"computes {sc.compute_s * 1000:.1f} ms per step, {sc.ratio:.2f}x the other ranks' "
            f"median {sc.median_s * 1000:.1f} ms (robust z {sc.z:.1f}) for {seen}"
        )
        self._events.emit(
            "fault_detected", fault="straggler", domain=domain, latency_s=latency, how=how
        )
        action = "evict" if self._evict else "report"
        self._events.emit(
            "straggler",
            domain=domain,
            compute_s=sc.compute_s,
            median_s=sc.median_s,
            ratio=sc.ratio,
            score=sc.z,
            windows=d.windows,
            action=action,
            latency_s=latency,
        )
        then = "evicting it" if self._evict else "reported (--on-straggler evict replaces it)"
        self._say(f"rank {sc.rank} is a straggler ({how}); detected in {latency:.1f} s, {then}")
        return Straggler(
            sc.rank, d.pid, self._node, sc.compute_s, sc.median_s, sc.ratio, sc.z,
            d.windows, latency, self._evict,
        )  # fmt: skip

    def isolate(self, s: Straggler) -> None:
        """Under ``evict``: end the rank's process; its exit is recovered as a failure
        with cause ``straggler`` by the strategy (a spare, flash, restart, elastic)."""
        w = self._workers.get(s.rank)
        if not s.evict or w is None or w.pid != s.pid:
            return
        self._watch.killed[s.pid] = f"evicted as a straggler ({s.ratio:.2f}x the others)"
        self._workers.kill(w, "straggler")
