"""Hang detection from the progress board (pure logic, tested in-process).

A job is hung when no worker finished a step for ``max(floor, k x p99)`` seconds,
where p99 is the recent p99 step time the workers publish (so a job with 10 s steps is
not declared hung after 1 s, and one with 10 ms steps does not wait a minute). The
culprit is then the worker whose heartbeat went stale (stopped or frozen); if every
heartbeat is fresh (a live deadlock), the workers that are not waiting in a collective.
If every local worker waits in a collective, the culprit is on another node and its
agent acts; these are killed only after the ceiling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stalwart.agent.progress import Slot
from stalwart.errors import ConfigError

__all__ = ["HangConfig", "HangVerdict", "find_hang"]


@dataclass(frozen=True)
class HangConfig:
    floor_s: float = 1.0
    k: float = 3.0
    ceiling_s: float = 300.0  # also the limit for a recovery or a first step
    alive_s: float = 0.5  # a heartbeat older than this is stale

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.ceiling_s or self.k <= 0 or self.alive_s <= 0:
            raise ConfigError(
                "hang detection needs 0 < floor <= ceiling, k > 0 and alive > 0; "
                f"got floor={self.floor_s} ceiling={self.ceiling_s} k={self.k}"
            )

    def threshold(self, p99_s: float) -> float:
        return min(self.ceiling_s, max(self.floor_s, self.k * p99_s))


@dataclass(frozen=True)
class HangVerdict:
    ranks: list[int]  # culprits to kill
    stalled_s: float  # how long the job made no progress
    threshold_s: float
    how: str


def find_hang(
    slots: Mapping[int, Slot], now: float, config: HangConfig, since: float = 0.0
) -> HangVerdict | None:
    """``slots``: rank -> its board slot (live workers only; a plain script's slot is
    watched once :mod:`stalwart.agent.observe` writes it); ``since``: when
    the last recovery began (nobody is blamed for the time before it)."""
    active = {
        r: s
        for r, s in slots.items()
        if (s.attached or s.observed) and s.phase in ("step", "collective")
    }
    if not active:
        return None
    p99 = max(s.p99_s for s in active.values())
    threshold = config.threshold(p99) if p99 > 0 else config.ceiling_s
    newest = max(since, *(s.t_progress for s in active.values()))
    stalled = now - newest
    stale = sorted(r for r, s in active.items() if now - s.t_alive > config.alive_s)
    # a stopped worker is a hang as soon as the job stalled past the threshold
    if stale and now - max(since, min(active[r].t_progress for r in stale)) > threshold:
        return HangVerdict(stale, stalled, threshold, "heartbeat stale, no step progress")
    if stalled <= threshold:
        return None
    computing = sorted(r for r, s in active.items() if s.phase == "step")
    if computing:
        return HangVerdict(computing, stalled, threshold, "no progress, not in a collective")
    if stalled > config.ceiling_s:
        return HangVerdict(sorted(active), stalled, threshold, "no progress until the ceiling")
    return None  # every local worker waits for a peer: the culprit is on another node
