"""Half-open time intervals ``(a, b)``: union and measure, shared by the accounting."""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time; empty ones dropped.

    Why a union: several ranks may report the same stall or restore, and a report must
    count wall time once, not once per reporter.
    """
    out: list[Interval] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def measure(merged: list[Interval], a: float, b: float) -> float:
    """Length of ``merged`` (a union) inside ``[a, b)``."""
    total = 0.0
    for x, y in merged:
        lo, hi = max(x, a), min(y, b)
        if hi > lo:
            total += hi - lo
    return total


def covers(merged: list[Interval], a: float, b: float) -> bool:
    """Whether the segment ``[a, b)`` (one that no boundary splits) lies inside ``merged``."""
    mid = (a + b) / 2
    return any(x <= mid < y for x, y in merged)
