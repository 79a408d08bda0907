"""Incidents: faults matched to their detection, recovery and the resumption of training.

Why a matching step: chaos writes ``fault_injected`` at the instant of the fault, every
survivor may write its own ``fault_detected`` for it, and natural faults have no
injection at all. One incident per fault keeps RTO and MTBF honest: a fault seen by
three ranks is one failure, and an injected fault's true time beats a detector's guess.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stalwart.metrics.events import Event
from stalwart.metrics.intervals import Interval, union

__all__ = ["Incident", "find_incidents", "recovery_spans", "resume_after"]


@dataclass
class Incident:
    """One fault. Times are wall-clock seconds; ``None`` where the log does not say."""

    index: int
    fault: str
    domain: dict[str, Any]
    injected: bool
    t_fault: float
    t_detected: float | None = None
    how: str = ""
    detections: int = 0  # fault_detected events folded into this incident
    t_resume: float | None = None  # start of the first step after recovery
    interrupted: bool = False  # training stopped for it (a recovery ran, or the run ended)
    strategy: str = ""
    restored_step: int | None = None
    steps_lost_reported: int | None = None
    source_tier: str = ""
    during_recovery: bool = False  # the fault struck while another recovery was under way
    overlaps: list[int] = field(default_factory=list)  # other incidents sharing its outage

    @property
    def detection_latency_s(self) -> float | None:
        return None if self.t_detected is None else self.t_detected - self.t_fault

    @property
    def rto_s(self) -> float | None:
        """Fault to the first step after recovery (the resumption of training)."""
        return None if self.t_resume is None else self.t_resume - self.t_fault


def _domain_match(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Keys both name must agree; a missing or ``None`` value (a node fault has no rank)
    matches anything."""
    return all(a[k] == b[k] for k in a.keys() & b.keys() if a[k] is not None and b[k] is not None)


def recovery_spans(events: Sequence[Event], t_end: float) -> list[Interval]:
    """Times when a recovery is open: from a ``recovery_begin`` until a ``recovery_end``
    of the same or a later generation (a fault during recovery opens a newer one, and
    its end closes both); still open at ``t_end`` if never closed."""
    spans: list[Interval] = []
    open_gens: list[int] = []
    t_open = 0.0
    for e in events:
        if e.kind == "recovery_begin":
            if not open_gens:
                t_open = e.t
            open_gens.append(int(e["generation"]))
        elif e.kind == "recovery_end" and open_gens:
            gen = int(e["generation"])
            open_gens = [g for g in open_gens if g > gen]
            if not open_gens:
                spans.append((t_open, e.t))
    if open_gens:
        spans.append((t_open, t_end))
    return union(spans)


def resume_after(t: float, window_starts: Sequence[float], spans: list[Interval]) -> float | None:
    """Start of the first step batch at or after ``t`` that no open recovery holds back."""
    i = bisect.bisect_left(window_starts, t)
    for t0 in window_starts[i:]:
        if not any(a <= t0 < b for a, b in spans):
            return t0
    return None


def _match_detection(incidents: list[Incident], e: Event, starts: Sequence[float]) -> bool:
    """Fold ``e`` into an existing incident; False when it is a fault of its own."""
    dom = dict(e["domain"])
    # The most recent undetected injection on the same domain is the fault it saw.
    for inc in reversed(incidents):
        if (
            inc.injected
            and inc.t_detected is None
            and inc.t_fault <= e.t
            and _domain_match(inc.domain, dom)
        ):
            inc.t_detected, inc.how, inc.detections = e.t, str(e.get("how", "")), 1
            return True
    # Another detector reporting a fault already detected, before training resumed.
    for inc in reversed(incidents):
        if inc.t_detected is not None and _domain_match(inc.domain, dom):
            j = bisect.bisect_right(starts, inc.t_detected)
            if j >= len(starts) or starts[j] > e.t:
                inc.detections += 1
                return True
    return False


def find_incidents(
    events: Sequence[Event], window_starts: Sequence[float], t_end: float
) -> tuple[list[Incident], list[Interval]]:
    """Every fault in ``events`` (sorted by time) with its detection and resumption;
    also returns the recovery spans (see :func:`recovery_spans`)."""
    incidents: list[Incident] = []
    for e in events:
        if e.kind == "fault_injected":
            incidents.append(
                Incident(len(incidents), str(e["fault"]), dict(e["domain"]), True, e.t)
            )
        elif e.kind == "fault_detected" and not _match_detection(incidents, e, window_starts):
            inc = Incident(
                len(incidents), str(e["fault"]), dict(e["domain"]), False, e.t - e["latency_s"]
            )
            inc.t_detected, inc.how, inc.detections = e.t, str(e.get("how", "")), 1
            incidents.append(inc)
    incidents.sort(key=lambda i: i.t_fault)
    for n, inc in enumerate(incidents):
        inc.index = n
    spans = recovery_spans(events, t_end)
    t_last_steps = max((e.t for e in events if e.kind == "steps"), default=-math.inf)
    begins = [e for e in events if e.kind == "recovery_begin"]
    ends = [e for e in events if e.kind == "recovery_end"]
    for inc in incidents:
        if inc.t_detected is None:  # undetected: a recovery that followed it stands in
            rb = next((b.t for b in begins if b.t >= inc.t_fault), None)
            if rb is None:
                continue
            inc.t_detected = rb
        inc.during_recovery = any(a < inc.t_fault < b for a, b in spans)
        inc.t_resume = resume_after(inc.t_detected, window_starts, spans)
        stop = t_end if inc.t_resume is None else inc.t_resume
        mine = [b for b in begins if inc.t_fault <= b.t <= stop]
        inc.interrupted = bool(mine) or inc.t_resume is None
        if not mine and t_last_steps > inc.t_detected:
            # training went on through it (a straggler or a probe only reported): no
            # recovery, so no resumption and no RTO to count
            inc.interrupted, inc.t_resume = False, None
        if mine:
            inc.strategy = str(mine[-1]["strategy"])
        done = [r for r in ends if inc.t_detected <= r.t <= stop]
        if done:
            restored, lost = done[-1]["restored_step"], done[-1]["steps_lost"]
            inc.restored_step = None if restored is None else int(restored)
            inc.steps_lost_reported = None if lost is None else int(lost)
            inc.source_tier = str(done[-1].get("source_tier", ""))
    for a in incidents:
        for b in incidents:
            if a is not b and a.interrupted and b.interrupted:
                a_end = t_end if a.t_resume is None else a.t_resume
                b_end = t_end if b.t_resume is None else b.t_resume
                if a.t_fault < b_end and b.t_fault < a_end:
                    a.overlaps.append(b.index)
    return incidents, spans
