"""Half-open time intervals ``(a, b)``: union, measure and lookups on a union.

Queries bisect the sorted union, so accounting a long run (10^5 step batches and as many
snapshots) stays O(n log n) rather than quadratic.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

Interval = tuple[float, float]
_INF = float("inf")


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


def _first(merged: list[Interval], a: float) -> int:
    """Index of the first interval of ``merged`` that may end after ``a``."""
    return max(bisect.bisect_right(merged, (a, _INF)) - 1, 0)


def overlapping(merged: list[Interval], a: float, b: float) -> list[Interval]:
    """The intervals of ``merged`` (a union) that meet ``(a, b)``."""
    out: list[Interval] = []
    for i in range(_first(merged, a), len(merged)):
        x, y = merged[i]
        if x >= b:
            break
        if y > a:
            out.append((x, y))
    return out


def measure(merged: list[Interval], a: float, b: float) -> float:
    """Length of ``merged`` (a union) inside ``[a, b)``."""
    return sum(min(y, b) - max(x, a) for x, y in overlapping(merged, a, b))


def covers(merged: list[Interval], a: float, b: float) -> bool:
    """Whether the segment ``[a, b)`` (one that no boundary splits) lies inside ``merged``."""
    mid = (a + b) / 2
    i = bisect.bisect_right(merged, (mid, _INF)) - 1
    return i >= 0 and merged[i][0] <= mid < merged[i][1]


def add(merged: list[Interval], a: float, b: float) -> float:
    """Insert ``[a, b)`` into the union ``merged`` in place; returns how much of it was
    already covered."""
    if b <= a:
        return 0.0
    hits = overlapping(merged, a, b)
    covered = sum(min(y, b) - max(x, a) for x, y in hits)
    # Touching neighbours merge too, so the list stays minimal.
    lo = bisect.bisect_left(merged, (a, -_INF))
    if lo > 0 and merged[lo - 1][1] >= a:
        lo -= 1
    hi = lo
    while hi < len(merged) and merged[hi][0] <= b:
        hi += 1
    new_a = min([a, *(merged[i][0] for i in range(lo, hi))])
    new_b = max([b, *(merged[i][1] for i in range(lo, hi))])
    merged[lo:hi] = [(new_a, new_b)]
    return covered
