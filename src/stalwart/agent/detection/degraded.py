"""A degraded link: the job's step rate collapses while every rank computes as before.

Loss or delay on the network between nodes does not fail a synchronous job: it slows
every collective, so every rank's step takes several times its usual time, and every
rank spends the extra time waiting in a collective, not computing. No detector sees that
as a fault: no process dies or stops, no rank computes slower than the others (the
straggler score compares compute times, agent/detection/stragglers.py), and the ranks still move,
so neither the hang bound nor the data plane watch (agent/detection/dataplane.py) is reached. 30%
loss between two nodes left 47 s between two steps with no event and no line.

The agent reads the same progress board as the straggler detector (compute time per
step, format version 2: runtime/steps/_progress.py) and adds nothing to the worker's step
loop. Every ``window_s`` (a window closes once every local rank completed a step in it,
or once its ranks waited ``window_s`` with none: a window with no step is judged on the
time since the last one) it judges this node's ranks (:class:`LinkWindows`):

- **slow**: the window's wall time per step (or the time since the last step, in a
  window with none) is at least ``ratio`` times the learned median, the median of the
  last ``history`` windows that were not slow (``learn`` of them before judging);
- **computing as before**: the ranks' median compute time per step grew by no more than
  ``compute_share`` of what the step time grew (a slowdown that is compute is a
  straggler's or the machine's, not the link's). A share, not a ratio of compute times:
  a job whose steps compute 9 ms sees 20-30 ms in a window now and then (measured on a
  loaded machine), 3x its median, which is nothing against a step gone from 190 to 750 ms;
- **waiting**: the ranks spent at least ``wait_share`` of the window in a collective
  (the board's phase, sampled at every read: a rank in an eval or a ``sess.pause`` is
  not). Only reads less than ``_MAX_GAP_S`` apart count: an agent whose loop sat in a
  slow store call (over the same lossy link) did not see what its ranks did meanwhile.

A window that is all three is *link-like*. A link fault slows every node alike, so each
agent publishes its verdict per window (one store write, as the straggler exchange) and
declares the link degraded (:func:`agreed`) after ``windows`` link-like windows in a row
here, with at least one step completed in them (a link that passes nothing is a
partition, the data plane watch's), when no other live node's fresh verdict says
otherwise. A slow node's own ranks do not wait (they compute or are stopped: the
straggler and hang detectors' faults), so its verdict contradicts. A node whose verdict
is not fresh is no counter-evidence: the far node of a lossy link sits in slow store
calls over that very link and publishes late (a dead node is no live member once its
lease expired).

The link recovers at the first window whose step time is back within ``recover_ratio``
of the median: an event and a line again.

Attribution: the other live nodes (with two nodes, the link between them). In
a larger job a degraded link slows every node alike (a ring collective runs at its
slowest link's pace), so which link it is cannot be told from step times: the event
names every other live node, and ``--on-degraded evict`` acts only where it names one
peer (docs/detection.md).
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.contract.board import Slot
from stalwart.errors import ConfigError

__all__ = [
    "DegradedAction",
    "DegradedConfig",
    "LinkWindow",
    "LinkWindows",
    "agreed",
]


_MAX_GAP_S = 0.5
"""Board reads further apart than this add nothing to a window's wait share (module
docstring: an agent loop held by a slow store call)."""


class DegradedAction(enum.Enum):
    """What the agent does with a degraded link (``--on-degraded``)."""

    REPORT = "report"
    """An event (``link_degraded``, then ``link_recovered``) and a line; the job goes on
    at the link's pace."""
    EVICT = "evict"
    """The node on the far side of the link is fenced and its ranks recovered as a lost
    node's (adopted under ``flash``, dropped under ``elastic``): the job goes on without
    the link, at its normal pace, with fewer nodes."""

    @classmethod
    def parse(cls, text: str) -> DegradedAction:
        for action in cls:
            if action.value == text:
                return action
        raise ConfigError(f"--on-degraded {text!r}: use report or evict")


@dataclass(frozen=True)
class DegradedConfig:
    """How the agent judges a degraded link (agent/detection/degraded.py's module docstring)."""

    action: DegradedAction = DegradedAction.REPORT
    """``report`` by default: a slow link is a cost, not a failure; ``evict`` drops the
    node behind it (its ranks adopted as a lost node's) when running without that node
    is cheaper than running at the link's pace."""
    ratio: float = 3.0
    """A window's step time must be at least this many times the learned median to be
    slow: a loaded machine's scheduling noise moves step time by up to 2-3x for a window
    now and then, but then compute time moves with it."""
    compute_share: float = 0.25
    """The ranks' compute time per step may grow by at most this share of what the step
    time grew: the slow step's time went to waiting, not computing (a slowdown that is
    compute is a straggler's or the machine's)."""
    wait_share: float = 0.5
    """Least share of a window the local ranks spent in a collective (averaged over the
    ranks): the slow step's time went to communication."""
    window_s: float = 3.0
    """Seconds per judged window (longer when no step completed yet)."""
    windows: int = 2
    """Link-like windows in a row (no other live node's fresh verdict saying otherwise)
    before the link is declared degraded: one slow window (a checkpoint, a GC pause) is
    nothing."""
    learn: int = 3
    """Windows that must have been seen (not slow) before any is judged: the median a
    window is compared with."""
    history: int = 20
    """Not-slow windows the learned medians are taken over (the newest)."""
    recover_ratio: float = 1.5
    """A window whose step time is back within this ratio of the median ends the
    degraded episode (an event and a line)."""

    def __post_init__(self) -> None:
        if not 0.1 <= self.window_s <= 3600.0:
            raise ConfigError(f"degraded-link window {self.window_s} s: use 0.1 .. 3600 s")
        if not 1.0 < self.recover_ratio < self.ratio or not 0.0 < self.compute_share < 1.0:
            raise ConfigError(
                "degraded-link ratios: use 1 < recover_ratio < ratio and compute_share in (0, 1)"
            )
        if not 0.0 < self.wait_share <= 1.0:
            raise ConfigError("degraded-link wait_share must be in (0, 1]")
        if self.windows < 1 or not 1 <= self.learn <= self.history <= 10_000:
            raise ConfigError("degraded-link windows >= 1 and 1 <= learn <= history <= 10000")


@dataclass(frozen=True)
class LinkWindow:
    """One judged window of this node's ranks."""

    t_start: float
    t_end: float
    generation: int  # the ranks' generation
    steps: int  # steps completed in it (the fewest of the local ranks)
    step_s: float  # wall time per step (with no step: the time since the last one)
    median_step_s: float  # the learned median (0: still learning)
    compute_s: float  # median compute time per step of the ranks (0: no step)
    median_compute_s: float
    wait_share: float  # share of the window the ranks spent in a collective
    slow: bool
    link_like: bool  # slow, computing as before, waiting

    @property
    def ratio(self) -> float:
        return self.step_s / self.median_step_s if self.median_step_s > 0 else 0.0

    def record(self) -> dict[str, Any]:
        """What this node publishes for the others (:func:`agreed` reads it)."""
        return {
            "t": self.t_end,
            "span": self.t_end - self.t_start,
            "generation": self.generation,
            "link": self.link_like,
            "ratio": self.ratio,
        }


@dataclass
class _Rank:
    pid: int
    compute_s: float
    steps: int
    t_step: float  # when its step count last grew (wall clock, as seen by the agent)
    seen: int = 0  # its step count at the last read
    waited: float = 0.0  # seconds seen in a collective in this window
    looked: float = 0.0  # seconds of this window the agent's reads covered


class LinkWindows:
    """The detector's state between board reads (one per agent)."""

    def __init__(self, cfg: DegradedConfig) -> None:
        self.cfg = cfg
        self._generation: int | None = None
        self._t_window = 0.0
        self._t_read = 0.0
        self._ranks: dict[int, _Rank] = {}
        self._step_hist: deque[float] = deque(maxlen=cfg.history)
        self._compute_hist: deque[float] = deque(maxlen=cfg.history)
        # the newest link-like windows in a row (oldest first), and the run's first
        self.run: deque[LinkWindow] = deque(maxlen=cfg.windows)
        self.first: LinkWindow | None = None

    def observe(self, slots: Mapping[int, Slot], now: float) -> LinkWindow | None:
        """Read the board's ``slots`` (rank -> slot) at wall clock ``now``, every loop
        turn; the window judged when one closes. A process's first 2 steps (start-up, a
        rebuilt group) are never measured; a new generation (a recovery) starts afresh."""
        measured = {r: s for r, s in slots.items() if s.attached and s.compute_steps >= 2}
        gens = {s.generation for s in measured.values()}
        generation = gens.pop() if len(gens) == 1 else None
        known = {r: (t.pid, t.seen) for r, t in self._ranks.items()}
        same = known.keys() == measured.keys() and all(
            known[r][0] == s.pid and known[r][1] <= s.compute_steps for r, s in measured.items()
        )  # the same processes (a replaced one, or a count gone back: a new process)
        if generation is None or generation != self._generation or not same:
            self._generation, self._t_window, self._t_read = generation, now, now
            self._ranks = {
                r: _Rank(s.pid, s.compute_s, s.compute_steps, now, s.compute_steps)
                for r, s in measured.items()
            }
            self.run.clear()
            self.first = None
            return None
        dt, self._t_read = now - self._t_read, now
        dt = dt if dt <= _MAX_GAP_S else 0.0  # the loop was away: nothing was seen
        for rank, s in measured.items():
            t = self._ranks[rank]
            t.looked += dt
            if s.phase == "collective":
                t.waited += dt
            if s.compute_steps > t.seen:
                t.t_step, t.seen = now, s.compute_steps
        span = now - self._t_window
        if span < self.cfg.window_s:
            return None
        steps = min(s.compute_steps - self._ranks[r].steps for r, s in measured.items())
        return self._close(measured, now, span, steps)

    def _close(self, slots: Mapping[int, Slot], now: float, span: float, steps: int) -> LinkWindow:
        cfg = self.cfg
        per_rank = []
        for rank, s in slots.items():
            t = self._ranks[rank]
            if s.compute_steps > t.steps:
                per_rank.append((s.compute_s - t.compute_s) / (s.compute_steps - t.steps))
        compute = statistics.median(per_rank) if per_rank and steps > 0 else 0.0
        looked = statistics.mean(t.looked for t in self._ranks.values())
        wait = statistics.mean(t.waited for t in self._ranks.values()) / looked if looked else 0.0
        last_step = min(t.t_step for t in self._ranks.values())
        step_s = span / steps if steps > 0 else now - last_step
        med_step = statistics.median(self._step_hist) if len(self._step_hist) >= cfg.learn else 0.0
        med_compute = statistics.median(self._compute_hist) if self._compute_hist else 0.0
        slow = med_step > 0 and step_s >= cfg.ratio * med_step
        grew = cfg.compute_share * max(0.0, step_s - med_step)
        computing_as_before = steps == 0 or compute - med_compute <= grew
        link_like = slow and computing_as_before and wait >= cfg.wait_share
        assert self._generation is not None  # (observe closes windows of one generation)
        window = LinkWindow(
            self._t_window, now, self._generation, steps, step_s, med_step,
            compute, med_compute, wait, slow, link_like,
        )  # fmt: skip
        if steps > 0 and not slow:
            self._step_hist.append(step_s)
            self._compute_hist.append(compute)
        if not link_like:
            self.run.clear()
            self.first = None
        else:
            self.run.append(window)
            self.first = self.first or window
        self._t_window = now
        for rank, s in slots.items():
            t = self._ranks[rank]
            t.compute_s, t.steps, t.waited, t.looked = s.compute_s, s.compute_steps, 0.0, 0.0
        return window

    def persisting(self) -> bool:
        """``windows`` link-like windows in a row here, at least one step completed in
        them (a link that passes nothing is a partition: the data plane watch's)."""
        run = self.run
        return len(run) == self.cfg.windows and any(w.steps > 0 for w in run)

    def recovered(self, window: LinkWindow) -> bool:
        """``window`` says the step time is back near the median."""
        return (
            window.steps > 0
            and window.median_step_s > 0
            and window.step_s <= self.cfg.recover_ratio * window.median_step_s
        )


def agreed(
    records: Mapping[int, dict[str, Any] | None], generation: int, now: float, window_s: float
) -> bool:
    """Whether no other live node (node -> its latest record, None where it published
    none) says otherwise: each record is link-like in ``generation``, or not fresh (not
    written within 3 of its own windows, or 3 ``window_s``, of ``now``; or unreadable).
    A node that cannot publish is no counter-evidence: its agent sits in slow store calls
    over the same link (measured: the far node of a 30% loss published a verdict every
    10-15 s); a dead one is no live member once its lease expired. A fresh verdict that
    the node computes, or does not wait (a straggler, an eval, a hang), or one of another
    generation (a recovery under way), is. Every field is checked, none trusted."""
    for rec in records.values():
        if not isinstance(rec, dict):
            continue
        t, span, gen, link = rec.get("t"), rec.get("span"), rec.get("generation"), rec.get("link")
        if not isinstance(t, int | float) or not isinstance(span, int | float) or span < 0:
            continue
        if now - t > 3 * max(window_s, min(float(span), 600.0)):
            continue
        if gen != generation or link is not True:
            return False
    return True
