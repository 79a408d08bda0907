"""Goodput accounting: every second of a run's wall time goes to exactly one bucket.

Why a partition of the timeline (not a sum of reported durations): durations reported by
several processes overlap (three ranks wait for the same restore; a second fault strikes
during the first one's recovery), so summing them counts time twice and the buckets stop
adding up. Here each instant is classified once, by a fixed priority, and the buckets add
up to the wall time by construction. Definitions and formulas: docs/goodput.md.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from stalwart.metrics.events import Event
from stalwart.metrics.incidents import Incident, find_incidents, resume_after
from stalwart.metrics.intervals import Interval, add, covers, measure, overlapping, union

__all__ = ["BUCKETS", "Goodput", "Resume", "Segment", "Window", "account"]

BUCKETS: tuple[str, ...] = (
    "productive",
    "startup",
    "checkpoint_stall",
    "restore",
    "lost_progress",
    "detection",
    "recovery",
    "waiting",
    "other",
)
# Outside step batches, the first of these whose intervals cover an instant wins.
_PRIORITY = (
    "checkpoint_stall",
    "restore",
    "waiting",
    "detection",
    "recovery",
    "lost_progress",
    "startup",
)
# The idle tail of a step batch (after its compute) that overlaps an incident.
_GAP_PRIORITY = ("waiting", "detection", "recovery", "lost_progress")


@dataclass(frozen=True)
class Window:
    """One ``steps`` batch and how its time was split."""

    t0: float
    t1: float
    first_step: int
    last_step: int
    busy_s: float
    generation: int | None
    world_size: int
    productive_steps: int
    productive_s: float
    lost_s: float
    stall_s: float
    other_s: float


@dataclass(frozen=True)
class Segment:
    t0: float
    t1: float
    bucket: str


@dataclass(frozen=True)
class Resume:
    """Training started again after an interruption (a fault or a reconfiguration)."""

    t: float
    step: int
    world_size: int
    cause: str  # "incident" or "reconfiguration"


@dataclass
class Goodput:
    t_start: float
    t_end: float
    wall_s: float  # exactly the sum of the buckets' parts (computed in run-relative time)
    buckets: dict[str, float]
    windows: list[Window]
    segments: list[Segment]
    incidents: list[Incident]
    resumes: list[Resume]
    world_sizes: list[tuple[float, int]]  # (time, world size) at each change
    lost_steps: int  # step completions later redone
    problems: list[str] = field(default_factory=list)

    @property
    def ettr(self) -> float | None:
        """Effective training time ratio: productive time over wall time."""
        return self.buckets["productive"] / self.wall_s if self.wall_s > 0 else None

    @property
    def capacity_ettr(self) -> float | None:
        """Productive time weighted by world size over the largest world size's wall
        time: an elastic run that shrank is charged for the capacity it ran without."""
        top = max((w for _, w in self.world_sizes), default=0)
        if self.wall_s <= 0 or top <= 0:
            return None
        done = math.fsum(w.productive_s * w.world_size for w in self.windows)
        return done / (top * self.wall_s)

    @property
    def productive_steps(self) -> int:
        return sum(w.productive_steps for w in self.windows)

    @property
    def failures(self) -> list[Incident]:
        return [i for i in self.incidents if i.interrupted]


def _world_sizes(events: Sequence[Event], t_start: float) -> list[tuple[float, int]]:
    out: list[tuple[float, int]] = []
    for e in events:
        if e.kind in ("run_start", "generation", "resize"):
            ws = int(e["world_size"])
            if not out or out[-1][1] != ws:
                out.append((max(e.t, t_start), ws))
    return out


def _ws_at(sizes: list[tuple[float, int]], t: float) -> int:
    i = bisect.bisect_right(sizes, (t, 1 << 62)) - 1
    return sizes[max(i, 0)][1] if sizes else 1


def _productive_counts(steps: list[Event]) -> list[int]:
    """Per batch, how many of its steps are the last completion of their number. A step
    completed again later (after a rollback) was lost work the first time."""
    done: list[Interval] = []  # step ranges completed later, as [first, last + 1)
    counts = [0] * len(steps)
    for n in range(len(steps) - 1, -1, -1):
        a, b = int(steps[n]["first_step"]), int(steps[n]["last_step"]) + 1
        counts[n] = (b - a) - round(add(done, a, b))
    return counts


def _classify(
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


def _waiting(events: Sequence[Event], starts: list[float], t_end: float) -> list[Interval]:
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


def _shift(e: Event, dt: float) -> Event:
    f = e.fields
    if e.kind == "steps":
        f = {**f, "t_first_start": f["t_first_start"] + dt}
    return Event(e.kind, e.t + dt, e.host, e.pid, e.node, e.rank, f)


def account(
    events: Sequence[Event], *, t_start: float | None = None, t_end: float | None = None
) -> Goodput:
    """Partition ``[t_start, t_end]`` (default: first ``run_start`` to last ``run_end``,
    else the first and last event) into :data:`BUCKETS`. ``events`` sorted by time.

    Why the arithmetic runs on times relative to the start: wall-clock timestamps near
    1.8e9 s carry only ~2e-7 s of precision, enough to make the buckets miss the wall
    time by a few ulps; relative times keep the partition exact to ~1e-15 of the run.
    """
    if not events:
        raise ValueError("no events to account")
    base = (
        t_start
        if t_start is not None
        else next((e.t for e in events if e.kind == "run_start"), events[0].t)
    )
    g = _account([_shift(e, -base) for e in events], None if t_end is None else t_end - base)
    for inc in g.incidents:
        inc.t_fault += base
        inc.t_detected = None if inc.t_detected is None else inc.t_detected + base
        inc.t_resume = None if inc.t_resume is None else inc.t_resume + base
    return Goodput(
        base,
        base + g.t_end,
        g.wall_s,
        g.buckets,
        [replace(w, t0=w.t0 + base, t1=w.t1 + base) for w in g.windows],
        [replace(x, t0=x.t0 + base, t1=x.t1 + base) for x in g.segments],
        g.incidents,
        [replace(r, t=r.t + base) for r in g.resumes],
        [(t + base, n) for t, n in g.world_sizes],
        g.lost_steps,
        g.problems,
    )


def _account(events: Sequence[Event], t_end: float | None) -> Goodput:
    problems: list[str] = []
    t0 = 0.0
    ends = [e.t for e in events if e.kind == "run_end"]
    steps = sorted((e for e in events if e.kind == "steps"), key=lambda e: e["t_first_start"])
    t1 = (
        t_end
        if t_end is not None
        else (ends[-1] if ends else max([events[-1].t, *(e.t for e in steps)]))
    )
    if t1 < t0:
        problems.append(f"the run ends {t0 - t1:.3f}s before it starts (clock skew?)")
        t1 = t0
    sizes = _world_sizes(events, t0)

    # Step batches, clipped to the run and to each other.
    raw: list[tuple[float, float, Event]] = []
    for e in steps:
        a, b = max(float(e["t_first_start"]), t0), min(e.t, t1)
        if raw and a < raw[-1][1]:
            problems.append(f"steps {e['first_step']}..{e['last_step']} overlap the batch before")
            a = raw[-1][1]
        if b > a:
            raw.append((a, b, e))
    counts = _productive_counts([e for _, _, e in raw])
    starts = [a for a, _, _ in raw]
    incidents, spans = find_incidents(events, starts, t1)

    stall = union((e.t - e["stall_s"], e.t) for e in events if e.kind == "snapshot")
    restore = union((e.t - e["seconds"], e.t) for e in events if e.kind == "restore")
    # Per batch: stall, restore and compute amounts. Compute first: busy_s is measured per
    # step and excludes stalls, so a stall that does not fit beside it was reported at the
    # wrong time and is clipped instead. The idle rest is taken to follow the compute (a
    # batch flushed when recovery starts ends with the time spent blocked).
    amounts: list[tuple[float, float, float]] = []
    for a, b, e in raw:
        busy = min(float(e["busy_s"]), b - a)
        st = min(measure(stall, a, b), b - a - busy)
        amounts.append((st, min(measure(restore, a, b), b - a - busy - st), busy))
    busy_end = [a + sum(x) for (a, _, _), x in zip(raw, amounts, strict=True)]
    labelled: dict[str, list[Interval]] = {
        "checkpoint_stall": stall,
        "restore": restore,
        "waiting": union(_waiting(events, starts, t1)),
    }
    detection: list[Interval] = []
    recovery: list[Interval] = list(spans)
    lost: list[Interval] = []
    resumes: dict[float, str] = {}
    for inc in incidents:
        if not inc.interrupted or inc.t_detected is None:
            continue
        f = inc.t_fault
        stop = t1 if inc.t_resume is None else inc.t_resume
        detection.append((f, inc.t_detected))
        recovery.append((inc.t_detected, stop))
        # Steps done (or in flight) after the last recorded one and before the fault.
        j = bisect.bisect_right(starts, f) - 1  # the last batch starting at or before f
        if j >= 0 and f < raw[j][1]:
            lost.append((busy_end[j], f))
        elif j >= 0:
            lost.append((raw[j][1], f))
        if inc.t_resume is not None:
            resumes[inc.t_resume] = "incident"
    first_step_t = starts[0] if starts else t1
    for e in events:  # reconfigurations: recoveries and resizes without a fault
        if e.kind in ("recovery_begin", "generation", "resize") and e.t > first_step_t:
            j = bisect.bisect_right(starts, e.t) - 1
            if j >= 0 and e.t < raw[j][1]:
                continue
            r = resume_after(e.t, starts, spans)
            recovery.append((e.t, t1 if r is None else r))
            if r is not None and r not in resumes:
                resumes[r] = "reconfiguration"
    labelled["detection"] = union(detection)
    labelled["recovery"] = union(recovery)
    labelled["lost_progress"] = union(lost)
    labelled["startup"] = [(t0, first_step_t)]

    buckets = dict.fromkeys(BUCKETS, 0.0)
    parts: dict[str, list[float]] = {b: [] for b in BUCKETS}
    segments: list[Segment] = []
    windows: list[Window] = []
    for (a, b, e), good, (st, rs, busy), be in zip(raw, counts, amounts, busy_end, strict=True):
        n = int(e["last_step"]) - int(e["first_step"]) + 1
        if n != int(e["count"]):
            problems.append(f"steps {e['first_step']}..{e['last_step']} say count={e['count']}")
        prod = busy if good >= n else busy * good / n
        parts["productive"].append(prod)
        parts["lost_progress"].append(busy - prod)
        parts["checkpoint_stall"].append(st)
        parts["restore"].append(rs)
        segments.append(Segment(a, be, "productive" if prod >= busy - prod else "lost_progress"))
        other = 0.0
        for x, y, name in _classify(be, b, labelled, _GAP_PRIORITY):
            parts[name].append(y - x)
            segments.append(Segment(x, y, name))
            other += (y - x) if name == "other" else 0.0
        windows.append(
            Window(
                a,
                b,
                int(e["first_step"]),
                int(e["last_step"]),
                busy,
                e.get("generation"),
                _ws_at(sizes, a),
                good,
                prod,
                busy - prod,
                st,
                other,
            )
        )

    cuts = sorted(
        {t0, t1, *(x for a, b, _ in raw for x in (a, b))}
        | {x for ivs in labelled.values() for iv in ivs for x in iv if t0 < x < t1}
    )
    in_window = [(a, b) for a, b, _ in raw]
    for a, b in itertools.pairwise(cuts):
        if b <= a or covers(in_window, a, b):
            continue
        name = next((k for k in _PRIORITY if covers(labelled[k], a, b)), "other")
        parts[name].append(b - a)
        if segments and segments[-1].bucket == name and segments[-1].t1 == a:
            segments[-1] = Segment(segments[-1].t0, b, name)
        else:
            segments.append(Segment(a, b, name))
    for k in BUCKETS:
        buckets[k] = math.fsum(parts[k])
    segments.sort(key=lambda s: s.t0)
    by_start = {w.t0: w for w in windows}
    resume_list = [
        Resume(t, by_start[t].first_step, by_start[t].world_size, resumes[t])
        for t in sorted(resumes)
        if t in by_start
    ]
    lost_steps = sum(w.last_step - w.first_step + 1 - w.productive_steps for w in windows)
    return Goodput(
        t0,
        t1,
        t1 - t0,
        buckets,
        windows,
        segments,
        incidents,
        resume_list,
        sizes,
        lost_steps,
        problems,
    )
