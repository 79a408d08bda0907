"""Hang detection from the progress board and each worker's CPU time (pure logic).

A hang is *no progress*, not a long step. A worker is one of:

- **stopped**: its process is in state ``T``/``t`` (SIGSTOP, a tracer). Nothing it could
  be doing is useful: it is a hang once it stayed stopped for ``floor``, whatever its
  step time. A stopped process makes no progress, so its step time says nothing about
  how long to wait; the floor is for a debugger or py-spy attaching (milliseconds).
  Scaling this bound with the step time found a stopped rank of 5 s steps after 15 s.
- **busy**: its CPU time (its own and its children's, e.g. data loader workers) advances
  at ``busy_frac`` of a core or more, or it is running (state ``R``): it computes (an
  eval, a save, a long step). Never blamed, and neither is anyone waiting for it.
- **paused**: inside ``with sess.pause(...)`` (declared non-step work). Never blamed
  unless stopped; its peers are not blamed for waiting.
- **idle**: no CPU progress (sleeping, blocked in I/O, waiting in a collective). Idle
  workers are blamed only when nobody is busy or paused and they stayed idle, with no
  rank's progress either (a step done, a declared pause ended), for
  ``max(idle_s, k x p99)``: first the ones outside a collective; when every worker
  waits and the agent sees the whole job (one node), all of them (a deadlock); when
  the peers they wait for may be on another node, only after the ceiling.

Why the heartbeat does not decide: a heartbeat thread that did not get the GIL for a
second says nothing when the process's CPU time advances (a long C++ call holding the
GIL), and a process at interpreter shutdown stops its daemon threads. ``p99`` is the
larger of what the worker publishes and what the agent remembers for its rank (the
step-time history of the job, not of the process: a replacement inherits it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from stalwart.contract.board import Slot
from stalwart.contract.env import DEFAULTS
from stalwart.errors import ConfigError

__all__ = ["Activity", "CpuTracker", "HangConfig", "HangVerdict", "find_hang"]


@dataclass(frozen=True)
class HangConfig:
    floor_s: float = 1.0
    """How long a worker may stay stopped (state T/t) before it is a hang, whatever its
    step time: a debugger or py-spy attaching stops a process for milliseconds. Also
    the least bound of the step-time rules (:meth:`threshold`)."""
    k: float = 3.0
    """Safety factor on the job's p99 step time (NVRx learns its timeouts the same way,
    with a factor of 5 over the longest interval seen)."""
    ceiling_s: float = DEFAULTS.hang_ceiling_s
    """Longest wait for a recovery or a first step, and for local workers that all wait
    in a collective for a peer on another node (whose own agent judges it)."""
    idle_s: float = 300.0
    """How long a worker must show no CPU progress, with no worker busy or paused,
    before it is declared stuck (a deadlock, a hung file system). torchrun leaves this
    to the collective timeout (30 min); torchft's is 60 s; a slow checkpoint write to a
    network file system must fit well within it."""
    busy_frac: float = 0.1
    """CPU share (of one core, over ``window_s``) above which a process is computing.
    A process waiting in a collective uses ~0.1% (its heartbeat thread)."""
    window_s: float = 1.0
    """Window over which the CPU share is measured (CPU time is counted in 10 ms
    ticks: 1 s resolves 1%)."""
    exit_grace_s: float = 60.0
    """Once a rank finished the job (exited 0, or passed the finish barrier), how long
    another may make no progress (no CPU, no step) before it is ended as hung at exit
    (agent/detection/_finished.py): its peers are gone, so it waits for nothing that can come; a
    final save or eval it computes alone is busy and never ended. Long enough for a
    final write to a slow file system; the job then ends with its result (rc 0)."""

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.ceiling_s or self.k <= 0:
            raise ConfigError(
                "hang detection needs 0 < floor <= ceiling and k > 0; "
                f"got floor={self.floor_s} ceiling={self.ceiling_s} k={self.k}: "
                "fix --hang-floor / --hang-k"
            )
        if self.idle_s < self.floor_s:
            raise ConfigError(
                f"--hang-idle {self.idle_s} is below --hang-floor {self.floor_s}; "
                "raise --hang-idle (seconds without CPU progress before a worker is stuck)"
            )
        if self.exit_grace_s <= 0:
            raise ConfigError(
                f"--exit-grace must be > 0 seconds, got {self.exit_grace_s}: the time a "
                "rank may make no progress after a peer finished the job"
            )
        if not 0 < self.busy_frac < 1 or self.window_s <= 0:
            raise ConfigError("hang detection needs 0 < busy_frac < 1 and window_s > 0")

    def threshold(self, p99_s: float) -> float:
        """The bound learned from the step time (``k x p99``, within floor..ceiling):
        for ranks that still run but wait (a collective of a generation the job left, a
        cut data plane), where a slow step must not look like a hang."""
        return min(self.ceiling_s, max(self.floor_s, self.k * p99_s))

    def stopped_threshold(self) -> float:
        """The bound for a stopped process: the floor. It makes no progress whatever
        its step time, so a job of 5 s steps does not wait 3 x 5 s to find it."""
        return self.floor_s


@dataclass(frozen=True)
class Activity:
    """What the agent saw of a worker's process (:class:`CpuTracker`)."""

    state: str  # /proc state letter of the main thread: R S D T t Z ...
    t_busy: float  # last time it was computing (its first sample before any)
    t_stopped: float = 0.0  # since when it is stopped (0: it is not)


class CpuTracker:
    """Turns one process's CPU-time samples into :class:`Activity` (pure: the agent
    reads /proc and feeds it)."""

    def __init__(self, config: HangConfig) -> None:
        self.config = config
        self._samples: deque[tuple[float, float]] = deque()
        self._t_busy = 0.0
        self._t_stopped = 0.0
        self._cpu = 0.0  # CPU seconds, only ever increased
        self._last_raw: float | None = None

    def update(self, t: float, cpu_s: float, state: str) -> Activity:
        """``cpu_s``: the process's user+system time (with its live children's) at ``t``."""
        if self._last_raw is not None:
            self._cpu += max(0.0, cpu_s - self._last_raw)  # a child that exited drops out
        self._last_raw = cpu_s
        if not self._t_busy:
            self._t_busy = t  # the benefit of the doubt until a window was seen
        self._samples.append((t, self._cpu))
        window = self.config.window_s
        while len(self._samples) > 2 and self._samples[1][0] <= t - window:
            self._samples.popleft()
        t0, c0 = self._samples[0]
        rate = (self._cpu - c0) / (t - t0) if t - t0 >= window / 2 else None
        stopped = state in ("T", "t")
        if not stopped and (state == "R" or (rate is not None and rate >= self.config.busy_frac)):
            self._t_busy = t
        if stopped:
            self._t_stopped = self._t_stopped or t
        else:
            self._t_stopped = 0.0
        return Activity(state, self._t_busy, self._t_stopped)


@dataclass(frozen=True)
class HangVerdict:
    ranks: list[int]  # culprits to kill
    stalled_s: float  # how long the culprits made no progress
    threshold_s: float
    how: str
    collateral: bool = False
    """The ranks are no culprits: they wait in a collective of a generation the job
    left because of another rank's (or node's) fault. Killing them is part of that
    recovery, not a failure of theirs (the crash-loop and isolation counts skip it)."""


_LIVE = ("starting", "step", "collective", "recovering", "paused")
_ACTIVE = ("step", "collective", "paused")


def find_hang(
    slots: Mapping[int, Slot],
    now: float,
    config: HangConfig,
    activity: Mapping[int, Activity],
    *,
    since: float = 0.0,
    history: Mapping[int, float] | None = None,
    whole_job: bool = False,
    generation: int | None = None,
) -> HangVerdict | None:
    """``slots``: rank -> its board slot (live workers only; a plain script's slot is
    watched once :mod:`stalwart.agent.processes.observe` wrote it); ``activity``: rank -> what its
    process does (a rank without one is never blamed); ``since``: when the last recovery
    began (nobody is blamed for the time before it); ``history``: rank -> the p99 step
    time the job saw for it; ``whole_job``: every member of the job is in ``slots``;
    ``generation``: the job's current one (None under elastic, whose members re-form at
    step boundaries themselves).

    The rules in order (module docstring): stopped, then a collective of a generation
    the job left (collateral), then no CPU progress."""
    sampled = {r: s for r, s in slots.items() if r in activity}
    if not sampled:
        return None
    hist = history or {}
    p99 = max(max(s.p99_s, hist.get(r, 0.0)) for r, s in sampled.items())
    j = _Judged(now, config, since, p99, config.threshold(p99))
    # a stopped process is a hang whatever it runs, even before its first step
    stopped = {
        r: now - max(since, activity[r].t_stopped)
        for r, s in sampled.items()
        if s.phase in _LIVE and activity[r].t_stopped > 0
    }
    bound = config.stopped_threshold()
    late = sorted(r for r, d in stopped.items() if d > bound)
    if late:
        how = "stopped (process state T: SIGSTOP or a tracer)"
        return HangVerdict(late, min(stopped[r] for r in late), bound, how)
    # busy and idle are judged only where steps are seen (the runtime's or a plain
    # script's optimizer steps): a script that steps no optimizer is never killed idle
    watched = {r: s for r, s in sampled.items() if s.attached or s.observed}
    if generation is not None:
        left = _left_behind(j, watched, set(stopped), generation)
        if left is not None:
            return left
    active = {r: s for r, s in watched.items() if s.phase in _ACTIVE and r not in stopped}
    if not active or len(active) < len([r for r in watched if watched[r].phase in _ACTIVE]):
        return None  # nobody to judge, or a stopped one is still within its threshold
    return _no_progress(j, active, activity, whole_job)


@dataclass(frozen=True)
class _Judged:
    """What every rule of :func:`find_hang` judges against."""

    now: float
    config: HangConfig
    since: float  # when the last recovery began
    p99: float  # the job's p99 step time
    threshold: float  # config.threshold(p99)


def _left_behind(
    j: _Judged, watched: Mapping[int, Slot], stopped: set[int], generation: int
) -> HangVerdict | None:
    """Waiting in a collective of a generation the job left (a silent machine's ranks
    were adopted elsewhere, a peer was replaced): nobody will ever answer it. These
    ranks are collateral of the fault that moved the generation."""
    left = sorted(
        r
        for r, s in watched.items()
        if s.attached
        and s.phase == "collective"
        and s.generation < generation
        and r not in stopped
        and j.now - max(j.since, s.t_progress) > j.threshold
    )
    if not left:
        return None
    how = f"waits in a collective of a generation the job left (now {generation})"
    stalled = j.now - max(j.since, watched[left[0]].t_progress)
    return HangVerdict(left, stalled, j.threshold, how, collateral=True)


def _no_progress(
    j: _Judged, active: Mapping[int, Slot], activity: Mapping[int, Activity], whole_job: bool
) -> HangVerdict | None:
    """Idle ranks, when nobody computes: first the ones outside a collective; all of
    them when the agent sees the whole job (a deadlock); else only after the ceiling."""
    config = j.config
    for r, s in active.items():
        if s.phase == "paused" or j.now - activity[r].t_busy < config.window_s:
            return None  # someone computes: the others wait for it
    limit = min(max(config.idle_s, config.k * j.p99), max(config.idle_s, config.ceiling_s))
    # idle since the job last moved: a peer's progress (a step done, a declared pause
    # just ended) means whoever waited for it was not stuck until then
    moved = max(j.since, *(s.t_progress for s in active.values()))
    idle = {r: j.now - max(moved, activity[r].t_busy) for r in active}
    stuck = sorted(r for r, d in idle.items() if d > limit)
    outside = [r for r in stuck if active[r].attached and active[r].phase == "step"]
    if outside:
        how = "no CPU progress outside a collective, no peer computing"
        return HangVerdict(outside, min(idle[r] for r in outside), limit, how)
    if len(stuck) < len(active):
        return None
    if whole_job:
        how = "no CPU progress on any rank of the job (a deadlock)"
        return HangVerdict(stuck, min(idle.values()), limit, how)
    if min(idle.values()) > max(limit, config.ceiling_s):
        how = "every local rank waited for a remote peer until the ceiling"
        return HangVerdict(stuck, min(idle.values()), max(limit, config.ceiling_s), how)
    return None  # the culprit is on another node: its agent acts
