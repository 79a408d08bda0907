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

from stalwart.metrics._timeline import classify, productive_counts, waiting, world_sizes, ws_at
from stalwart.metrics.events import Event
from stalwart.metrics.incidents import Incident, find_incidents, resume_after
from stalwart.metrics.intervals import Interval, covers, measure, union

__all__ = ["BUCKETS", "Goodput", "Resume", "Segment", "Window", "account", "launch_time"]

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
    # a plain script resumed from its own checkpoint at a step stalwart could not see (its
    # optimizer holds no step count): the steps it redid are not known, so lost_steps and
    # lost_progress leave them out, and the productive time (ETTR) is an upper bound
    lost_unknown: bool = False

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


def _shift(e: Event, dt: float) -> Event:
    f = e.fields
    if e.kind == "steps":
        f = {**f, "t_first_start": f["t_first_start"] + dt}
    return Event(e.kind, e.t + dt, e.host, e.pid, e.node, e.rank, f)


def launch_time(events: Sequence[Event]) -> float:
    """When the run was launched: the first ``run_start``'s ``launch_t`` (not after the
    event itself), or the event's time, or the first event's in a log without one."""
    start = next((e for e in events if e.kind == "run_start"), None)
    if start is None:
        return events[0].t
    return min(float(start.get("launch_t", start.t)), start.t)


def account(
    events: Sequence[Event], *, t_start: float | None = None, t_end: float | None = None
) -> Goodput:
    """Partition ``[t_start, t_end]`` (default: the launch to the last ``run_end``, else
    the first and last event) into :data:`BUCKETS`. ``events`` sorted by time. The launch:
    the first ``run_start``'s ``launch_t`` (its agent's start: the zygote's imports and the
    rendezvous come before the event), or its time in a log without it.

    Why the arithmetic runs on times relative to the start: wall-clock timestamps near
    1.8e9 s carry only ~2e-7 s of precision, enough to make the buckets miss the wall
    time by a few ulps; relative times keep the partition exact to ~1e-15 of the run.
    """
    if not events:
        raise ValueError("no events to account")
    base = t_start if t_start is not None else launch_time(events)
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
        g.lost_unknown,
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
    sizes = world_sizes(events, t0)
    raw = _batches(steps, t0, t1, problems)
    starts = [a for a, _, _ in raw]
    incidents, spans = find_incidents(events, starts, t1)
    stall = union((e.t - e["stall_s"], e.t) for e in events if e.kind == "snapshot")
    restore = union((e.t - e["seconds"], e.t) for e in events if e.kind == "restore")
    amounts = _amounts(raw, stall, restore)
    busy_end = [a + sum(x) for (a, _, _), x in zip(raw, amounts, strict=True)]
    labelled: dict[str, list[Interval]] = {
        "checkpoint_stall": stall,
        "restore": restore,
        "waiting": union(waiting(events, starts, t1)),
    }
    resumes = _label_incidents(events, incidents, spans, raw, busy_end, t1, labelled)
    labelled["startup"] = [(t0, starts[0] if starts else t1)]

    split = _Split()
    counts = productive_counts([e for _, _, e in raw])
    windows = [
        split.batch(batch, good, amount, be, labelled, ws_at(sizes, batch[0]), problems)
        for batch, good, amount, be in zip(raw, counts, amounts, busy_end, strict=True)
    ]
    split.gaps(t0, t1, raw, labelled)
    by_start = {w.t0: w for w in windows}
    resume_list = [
        Resume(t, by_start[t].first_step, by_start[t].world_size, resumes[t])
        for t in sorted(resumes)
        if t in by_start
    ]
    lost_steps = sum(w.last_step - w.first_step + 1 - w.productive_steps for w in windows)
    buckets = {k: math.fsum(split.parts[k]) for k in BUCKETS}
    split.segments.sort(key=lambda s: s.t0)
    return Goodput(
        t0,
        t1,
        t1 - t0,
        buckets,
        windows,
        split.segments,
        incidents,
        resume_list,
        sizes,
        lost_steps,
        problems,
        any(bool(e.get("resume_unknown", False)) for e in steps),
    )


_Batch = tuple[float, float, Event]  # a step batch clipped to the run: (a, b, its event)


def _batches(steps: list[Event], t0: float, t1: float, problems: list[str]) -> list[_Batch]:
    """Step batches, clipped to the run and to each other."""
    raw: list[_Batch] = []
    for e in steps:
        a, b = max(float(e["t_first_start"]), t0), min(e.t, t1)
        if raw and a < raw[-1][1]:
            problems.append(f"steps {e['first_step']}..{e['last_step']} overlap the batch before")
            a = raw[-1][1]
        if b > a:
            raw.append((a, b, e))
    return raw


def _amounts(
    raw: list[_Batch], stall: list[Interval], restore: list[Interval]
) -> list[tuple[float, float, float]]:
    """Per batch: stall, restore and compute amounts. Compute first: busy_s is measured
    per step and excludes stalls, so a stall that does not fit beside it was reported at
    the wrong time and is clipped instead. The idle rest is taken to follow the compute
    (a batch flushed when recovery starts ends with the time spent blocked)."""
    amounts: list[tuple[float, float, float]] = []
    for a, b, e in raw:
        busy = min(float(e["busy_s"]), b - a)
        st = min(measure(stall, a, b), b - a - busy)
        amounts.append((st, min(measure(restore, a, b), b - a - busy - st), busy))
    return amounts


def _label_incidents(
    events: Sequence[Event],
    incidents: list[Incident],
    spans: list[Interval],
    raw: list[_Batch],
    busy_end: list[float],
    t1: float,
    labelled: dict[str, list[Interval]],
) -> dict[float, str]:
    """Label detection, recovery and lost progress of every interrupting incident and of
    reconfigurations (recoveries and resizes without a fault); the resumes they end in."""
    starts = [a for a, _, _ in raw]
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
    return resumes


@dataclass
class _Split:
    """The run's time as it is split: each bucket's pieces and the timeline segments."""

    parts: dict[str, list[float]] = field(default_factory=lambda: {b: [] for b in BUCKETS})
    segments: list[Segment] = field(default_factory=list)

    def batch(
        self,
        batch: _Batch,
        good: int,
        amount: tuple[float, float, float],
        busy_end: float,
        labelled: dict[str, list[Interval]],
        world_size: int,
        problems: list[str],
    ) -> Window:
        """A step batch: its compute (productive, or lost when redone later), stall,
        restore, then its idle tail by what covers it."""
        (a, b, e), (st, rs, busy) = batch, amount
        n = int(e["last_step"]) - int(e["first_step"]) + 1
        if n != int(e["count"]):
            problems.append(f"steps {e['first_step']}..{e['last_step']} say count={e['count']}")
        prod = busy if good >= n else busy * good / n
        self.parts["productive"].append(prod)
        self.parts["lost_progress"].append(busy - prod)
        self.parts["checkpoint_stall"].append(st)
        self.parts["restore"].append(rs)
        kind = "productive" if prod >= busy - prod else "lost_progress"
        self.segments.append(Segment(a, busy_end, kind))
        other = 0.0
        for x, y, name in classify(busy_end, b, labelled, _GAP_PRIORITY):
            self.parts[name].append(y - x)
            self.segments.append(Segment(x, y, name))
            other += (y - x) if name == "other" else 0.0
        first, last = int(e["first_step"]), int(e["last_step"])
        gen = e.get("generation")
        return Window(a, b, first, last, busy, gen, world_size, good, prod, busy - prod, st, other)

    def gaps(
        self, t0: float, t1: float, raw: list[_Batch], labelled: dict[str, list[Interval]]
    ) -> None:
        """The time outside step batches, each piece to the first label covering it."""
        cuts = sorted(
            {t0, t1, *(x for a, b, _ in raw for x in (a, b))}
            | {x for ivs in labelled.values() for iv in ivs for x in iv if t0 < x < t1}
        )
        in_window = [(a, b) for a, b, _ in raw]
        for a, b in itertools.pairwise(cuts):
            if b <= a or covers(in_window, a, b):
                continue
            name = next((k for k in _PRIORITY if covers(labelled[k], a, b)), "other")
            self.parts[name].append(b - a)
            last = self.segments[-1] if self.segments else None
            if last is not None and last.bucket == name and last.t1 == a:
                self.segments[-1] = Segment(last.t0, b, name)
            else:
                self.segments.append(Segment(a, b, name))
