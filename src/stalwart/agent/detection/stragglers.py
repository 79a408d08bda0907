"""Straggler scoring: which rank computes persistently slower than the job's others.

A straggler holds a synchronous job back without failing: every rank's step lasts as
long as the slowest one's, so step time is the same everywhere and names nobody. What
differs is *compute time*, a step's wall time less the time the rank was blocked in a
collective or a ``sess.pause`` (published on the progress board, format version 2:
runtime/steps/_progress.py): the slow rank computes, its peers wait for it.

The decision is NVRx's and Falcon's shape, made robust for small jobs on noisy machines:

- **windows**: every ``window_s`` the median compute time per step of each rank over
  the window (the agent reads the board's running sums every few ms; each read that
  saw steps complete adds their mean, weighted by their count). A window in which the
  generation changed (a recovery) or a rank made fewer than ``min_steps`` steps is not
  scored;
- **robust score**: each rank against the *others* (leave-one-out median and MAD:
  with 2 ranks the other rank is the reference; with many, one slow rank cannot drag
  the reference with it). ``z = (x - median) / max(1.4826 * MAD, floor * median)``;
  the floor keeps a job of near-identical ranks (MAD ~ 0) from flagging a 2% wobble;
- **persistence**, two ways, once per process: ``windows`` flagged windows *in a row*
  (``z >= z`` and ``x / median >= min_ratio``: 1.35x with the floor), or a *sustained*
  excess: ``sustained`` of the last ``of_last`` windows at ``x / median >=
  sustained_ratio``. Measured on a loaded 2-core machine: a fault-free rank is sometimes
  seen at 1.8-2.3x for a window (another process on its core), in bursts a window or two
  apart, so 3 flagged of the last 5 declared 2 fault-free ranks in 10 minutes, and no
  per-window threshold tells those from a 3x rank (seen at 1.8x); a rank slowed 1.5x is
  seen at ~1.4-1.5x, under the flag in some of its windows, and 3 in a row took
  70 s. Bursts do last 3 and 4 windows now and then (each declared a fault-free rank
  in a 10-minute run, under 3 and under 4 in a row), never 5 in the runs measured,
  and never 6 of 8 at 1.25x (at most 4). The in-a-row rule finds the strong, steady
  slowdown; the sustained rule the moderate one, which is elevated in nearly every
  window, where bursts are not.

With the defaults (3 s windows, 5 in a row, z 3.5, floor 10%; or 6 of the last 8 at
1.25x) a rank slowed 3x is declared 12-15 s after the slowdown began when no window is
noisy (18-21 s by the sustained rule when one is), a rank slowed 1.5x in 18-30 s;
docs/detection.md gives the figures measured.
"""

from __future__ import annotations

import enum
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from stalwart.contract.board import Slot
from stalwart.errors import ConfigError, StalwartError

__all__ = [
    "ComputeExchange",
    "Declared",
    "PeerMedians",
    "RankScore",
    "StragglerAction",
    "StragglerConfig",
    "StragglerWindows",
    "robust_scores",
]

PeerMedians = Callable[[dict[int, float], int], dict[int, float]]
"""Publish this node's window medians (rank -> seconds per step) of ``generation``;
return the other nodes' latest of the same generation (:class:`ComputeExchange`)."""

_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x this = its standard deviation


class StragglerAction(enum.Enum):
    """What the agent does with a declared straggler (``--on-straggler``)."""

    REPORT = "report"
    """An event, a line, the report's section and a metric; the rank keeps running."""
    EVICT = "evict"
    """The rank's process is ended and replaced by the strategy's means: a spare
    (``spare``), a fresh process restored from memory (``flash``), every worker restarted
    (``restart``), the member dropped and started again (``elastic``)."""

    @classmethod
    def parse(cls, text: str) -> StragglerAction:
        for action in cls:
            if action.value == text:
                return action
        raise ConfigError(f"--on-straggler {text!r}: use report or evict")


@dataclass(frozen=True)
class StragglerConfig:
    """How the agent judges stragglers (agent/detection/stragglers.py's module docstring)."""

    action: StragglerAction = StragglerAction.REPORT
    """``report`` by default: a slow rank is a cost, not a failure, and replacing it is
    not free (a restore, maybe a spare); ``evict`` when a spare or a flash restart is
    cheaper than running at the straggler's pace."""
    window_s: float = 3.0
    """Seconds per scored window: long enough to hold several steps of most jobs and to
    average a loaded machine's scheduling noise, short enough that 5 windows find a 3x
    slowdown within 20 s (12-15 s)."""
    windows: int = 5
    """Consecutive flagged windows before a rank is declared: one noisy window (another
    process on the core, a page-cache flush) never declares anyone, nor a burst of 3 or
    4 (12 s at 1.4-2.0x declared a fault-free rank of a 10-minute run under 4 in a row,
    9 s at 2.3x one under 3); a 3x rank still falls within 20 s (12-15 s)."""
    sustained: int = 6
    """Windows at ``sustained_ratio`` or more, among the last ``of_last``, that declare a
    rank too (the moderate straggler a noisy window interrupts; module docstring)."""
    of_last: int = 8
    """The scored windows ``sustained`` is counted over: 2 noisy windows of a slow rank
    pass; bursts of a fault-free rank (a window here and there) never gather 6."""
    sustained_ratio: float = 1.25
    """The ratio to the others' median a window must reach for the sustained rule: under
    the flag's 1.35x, which a 1.5x rank seen through noise misses in some windows."""
    z: float = 3.5
    """Robust z-score a rank's compute time must reach against the others' median."""
    min_ratio: float = 1.2
    """...and this ratio to their median: a rank a little slower than very uniform peers
    is not worth an event."""
    spread_floor: float = 0.1
    """The spread the z-score divides by is at least this fraction of the median (the
    others' MAD is 0 with 2 ranks, and near 0 with identical ones)."""
    min_steps: int = 3
    """Fewest steps a rank must complete in a window for it to be scored (a job of
    steps longer than the window is scored over longer windows: see StragglerWindows)."""

    def __post_init__(self) -> None:
        if not 0.1 <= self.window_s <= 3600.0:
            raise ConfigError(f"straggler window {self.window_s} s: use 0.1 .. 3600 seconds")
        ok = 1 <= self.windows <= self.of_last and 1 <= self.sustained <= self.of_last <= 1000
        if not ok or self.min_steps < 1 or self.sustained_ratio < 1.0:
            raise ConfigError(
                "straggler windows, sustained and min_steps must be >= 1, each <= of_last "
                "<= 1000, sustained_ratio >= 1"
            )
        if self.z <= 0 or self.min_ratio < 1.0 or not 0 < self.spread_floor <= 10:
            raise ConfigError("straggler z must be > 0, min_ratio >= 1, spread_floor in (0, 10]")


@dataclass(frozen=True)
class RankScore:
    """One rank's standing in one window."""

    rank: int
    compute_s: float  # its mean compute time per step in the window
    median_s: float  # the others' median
    ratio: float  # compute_s / median_s
    z: float  # robust z-score against the others
    flagged: bool


def robust_scores(means: dict[int, float], cfg: StragglerConfig) -> list[RankScore]:
    """Score every rank of ``means`` (rank -> mean compute seconds per step) against
    the others; empty with fewer than 2 ranks (nobody to compare with)."""
    if len(means) < 2:
        return []
    out = []
    for rank, x in sorted(means.items()):
        others = [v for r, v in means.items() if r != rank]
        med = statistics.median(others)
        if med <= 0:
            continue
        mad = statistics.median(abs(v - med) for v in others)
        spread = max(_MAD_TO_SIGMA * mad, cfg.spread_floor * med)
        ratio, z = x / med, (x - med) / spread
        out.append(RankScore(rank, x, med, ratio, z, z >= cfg.z and ratio >= cfg.min_ratio))
    return out


@dataclass
class _Track:
    """One rank's process as the detector follows it: the board's running sums at the
    last read, and the window's per-step compute times (value, steps it covers)."""

    pid: int
    compute_s: float
    steps: int
    samples: list[tuple[float, int]] = field(default_factory=list)

    def follow(self, s: Slot) -> None:
        if s.compute_steps > self.steps:
            n = s.compute_steps - self.steps
            self.samples.append(((s.compute_s - self.compute_s) / n, n))
            self.compute_s, self.steps = s.compute_s, s.compute_steps

    def median(self) -> float:
        """The window's median compute time per step (weighted by steps covered): a rank
        0 evaluating every few steps, a GC pause or a burst of another process on the
        core moves a mean, not the median."""
        ordered = sorted(self.samples)
        half, seen = sum(n for _, n in ordered) / 2, 0
        for value, n in ordered:
            seen += n
            if seen >= half:
                return value
        return 0.0


@dataclass(frozen=True)
class Declared:
    """A rank that stayed slow for ``windows`` of its last ``of`` windows (the in-a-row
    rule: ``windows == of``): what the detector reports."""

    score: RankScore
    pid: int
    windows: int
    of: int
    t_first: float  # start of the first flagged window (wall clock)


class StragglerWindows:
    """The detector's state between board reads: each rank's running sums at the
    window's start, its flagged-window count, the pids already declared."""

    def __init__(self, cfg: StragglerConfig) -> None:
        self.cfg = cfg
        self._t_window = 0.0
        self._generation: int | None = None
        self._tracks: dict[int, _Track] = {}
        # rank -> its last ``of_last`` scored windows: (flagged, ratio, the window's start)
        self._history: dict[int, deque[tuple[bool, float, float]]] = {}
        self._declared: set[int] = set()  # pids
        self.last: list[RankScore] = []  # the latest scored window (for the metrics)

    def observe(
        self, slots: dict[int, Slot], now: float, peers: PeerMedians | None = None
    ) -> list[Declared]:
        """Read the board's ``slots`` (rank -> slot) at wall-clock ``now`` (every few
        ms: each read adds the steps completed since the last one); the ranks declared
        when a window closes. A process's first 2 steps (DDP's first iteration, a
        rebuilt group) are never scored. ``peers``: the other nodes' ranks to score
        against (a job of several nodes); only this node's ranks are declared."""
        measured = {r: s for r, s in slots.items() if s.attached and s.compute_steps >= 2}
        gens = {s.generation for s in measured.values()}
        generation = gens.pop() if len(gens) == 1 else None
        if generation is None or generation != self._generation:
            self._t_window, self._generation = now, generation  # a recovery: start again
            self._history.clear()  # a replaced process is judged on its own windows
            self._tracks = {
                r: _Track(s.pid, s.compute_s, s.compute_steps) for r, s in measured.items()
            }
            return []
        for rank, s in measured.items():
            t = self._tracks.get(rank)
            if t is None or t.pid != s.pid or s.compute_steps < t.steps:
                self._tracks[rank] = _Track(s.pid, s.compute_s, s.compute_steps)  # a new process
            else:
                t.follow(s)
        if now - self._t_window < self.cfg.window_s:
            return []
        local = {
            r: t.median() for r, t in self._tracks.items()
            if r in measured and sum(n for _, n in t.samples) >= self.cfg.min_steps
        }  # fmt: skip
        if len(local) < (1 if peers else 2) and now - self._t_window < 8 * self.cfg.window_s:
            return []  # steps longer than the window: let it grow (up to 8 windows)
        t_start, self._t_window = self._t_window, now
        for t in self._tracks.values():
            t.samples.clear()
        others = peers(local, generation) if peers is not None and local else {}
        scores = robust_scores({**others, **local}, self.cfg)
        self.last = [sc for sc in scores if sc.rank in local]
        return self._persisting(self.last, measured, t_start)

    def _persisting(
        self, scores: list[RankScore], measured: dict[int, Slot], t_start: float
    ) -> list[Declared]:
        out = []
        scored = {sc.rank for sc in scores}
        for rank in set(self._history) - scored:
            del self._history[rank]  # a rank no longer scored (left, replaced) starts afresh
        for sc in scores:
            seen = self._history.setdefault(sc.rank, deque(maxlen=self.cfg.of_last))
            seen.append((sc.flagged, sc.ratio, t_start))
            found = self._rule(list(seen))
            pid = measured[sc.rank].pid
            if found is not None and pid not in self._declared:
                self._declared.add(pid)
                out.append(Declared(sc, pid, *found))
        return out

    def _rule(self, seen: list[tuple[bool, float, float]]) -> tuple[int, int, float] | None:
        """(windows, of, t_first) when ``seen`` (oldest first) declares its rank."""
        cfg = self.cfg
        run = seen[-cfg.windows :]
        if len(run) == cfg.windows and all(flagged for flagged, _, _ in run):
            return cfg.windows, cfg.windows, run[0][2]
        high = [t for _, ratio, t in seen if ratio >= cfg.sustained_ratio]
        if len(high) >= cfg.sustained and seen[-1][1] >= cfg.sustained_ratio:
            return len(high), len(seen), high[0]
        return None


class Records(Protocol):
    """The job's launch records in the coordinator store (agent/cluster/_cluster.py)."""

    def publish(self, key: str, record: dict[str, Any]) -> None: ...
    def read(self, key: str, timeout: float) -> dict[str, Any]: ...


class ComputeExchange:
    """A job of several nodes: each agent publishes its ranks' window medians under
    ``straggler-n<node>`` (one store write per window) and scores its ranks against the
    latest of the next ``peers`` nodes in the ring of node ids besides its own, so the
    reference is other nodes', not only the node's (a whole node slowed alike stands
    out). A record older than 3 windows, of another generation, or malformed is left out
    (never trusted: every field is checked).

    Why a few peers, not every node: every node reading every other node's record each
    window is N - 1 reads per node per window, O(N^2) for the job (at 1,024 nodes and 3 s
    windows, 350,000 requests a second); a leave-one-out median over 5 nodes' ranks (40
    at 8 a node) is as robust a reference, and one slow node is outvoted in every
    neighbour's reference. The cost is O(1) per node: one write, ``peers`` reads."""

    def __init__(
        self, records: Records, node: int, nnodes: int, window_s: float, *, peers: int = 4
    ) -> None:
        self._records, self._node, self._nnodes = records, node, nnodes
        self._max_age_s = 3 * window_s
        self._peers = [(node + k) % nnodes for k in range(1, min(peers, nnodes - 1) + 1)]

    def __call__(self, local: dict[int, float], generation: int) -> dict[int, float]:
        now = time.time()
        mine = {
            "t": now,
            "generation": generation,
            "medians": {str(r): v for r, v in local.items()},
        }
        others: dict[int, float] = {}
        try:
            self._records.publish(f"straggler-n{self._node}", mine)
            for node in self._peers:
                others.update(self._read(node, now, generation))
        except (StalwartError, OSError, ValueError):
            pass  # the store is slow or away: this window is scored within the node
        return others

    def _read(self, node: int, now: float, generation: int) -> dict[int, float]:
        try:
            rec = self._records.read(f"straggler-n{node}", 0.0)
        except StalwartError:
            return {}  # not published yet
        t, gen, medians = rec.get("t"), rec.get("generation"), rec.get("medians")
        if not isinstance(t, int | float) or abs(now - t) > self._max_age_s:
            return {}
        if gen != generation or not isinstance(medians, dict) or len(medians) > 1_000_000:
            return {}
        out = {}
        for rank, v in medians.items():
            ok = isinstance(rank, str) and rank.isdigit() and isinstance(v, int | float)
            if ok and math.isfinite(v) and 0 < v < 86400:
                out[int(rank)] = float(v)
        return out
