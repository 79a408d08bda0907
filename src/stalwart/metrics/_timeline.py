"""The timeline arithmetic of goodput accounting (metrics/goodput.py): world sizes over
time, the steps that count as productive, waits, and cutting an interval by labels."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from stalwart.metrics.events import Event
from stalwart.metrics.intervals import Interval, add, covers, overlapping

__all__ = ["classify", "productive_counts", "waiting", "world_sizes", "ws_at"]


def world_sizes(events: Sequence[Event], t_start: float) -> list[tuple[float, int]]:
    out: list[tuple[float, int]] = []
    for e in events:
        if e.kind in ("run_start", "generation", "resize"):
            ws = int(e["world_size"])
            if not out or out[-1][1] != ws:
                out.append((max(e.t, t_start), ws))
    return out


def ws_at(sizes: list[tuple[float, int]], t: float) -> int:
    i = bisect.bisect_right(sizes, (t, 1 << 62)) - 1
    return sizes[max(i, 0)][1] if sizes else 1


def productive_counts(steps: list[Event]) -> list[int]:
    """Per batch, how many of its steps are the last completion of their number. A step
    completed again later (after a rollback) was lost work the first time."""
    done: list[Interval] = []  # step ranges completed later, as [first, last + 1)
    counts = [0] * len(steps)
    for n in range(len(steps) - 1, -1, -1):
        a, b = int(steps[n]["first_step"]), int(steps[n]["last_step"]) + 1
        counts[n] = (b - a) - round(add(done, a, b))
    return counts


def classify(
    a: float, b: float, labelled: dict[str, list[Interval]], priority: tuple[str, ...]
) -> list[tuple[float, float, str]]:
    """``[a, b)`` cut where any labelled interval starts or ends, each piece named by the
    first of ``priority`` that covers it, else "other"."""
    if b <= a:
        return []
    cuts = sorted(
        {a, b}
        | {x for k in priority for iv in overlapping(labelled[k], a, b) for x in iv if a < x < b}
    )
    out: list[tuple[float, float, str]] = []
    for x, y in itertools.pairwise(cuts):
        name = next((k for k in priority if covers(labelled[k], x, y)), "other")
        if out and out[-1][2] == name:
            out[-1] = (out[-1][0], y, name)
        else:
            out.append((x, y, name))
    return out


def waiting(events: Sequence[Event], starts: list[float], t_end: float) -> list[Interval]:
    out: list[Interval] = []
    t_open: float | None = None
    for e in events:
        if e.kind == "waiting" and t_open is None and e["have"] < e["need"]:
            t_open = e.t
        elif t_open is not None and (
            (e.kind == "waiting" and e["have"] >= e["need"])
            or e.kind in ("generation", "recovery_end", "run_end")
        ):
            out.append((t_open, e.t))
            t_open = None
    if t_open is not None:
        out.append((t_open, t_end))
    # A step batch starting also ends a wait.
    ends = []
    for a, b in out:
        i = bisect.bisect_left(starts, a)
        ends.append((a, min(b, starts[i]) if i < len(starts) else b))
    return ends
