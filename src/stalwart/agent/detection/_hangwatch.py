"""The agent's view of its workers' processes between board reads (agent/detection/_detectors.py's
hang detector and agent/detection/_dataplane_watch.py's watch sample through it)."""

from __future__ import annotations

from stalwart.agent.detection.hang import Activity, CpuTracker, HangConfig
from stalwart.agent.processes._proc import read_cpu
from stalwart.contract.board import Slot

__all__ = ["HangWatch"]

_SAMPLE_S = 0.1


class HangWatch:
    """The agent's view of its workers' processes between board reads: one CPU tracker
    per worker process, and the step-time history of each rank (the job's, not the
    process's: a replacement is judged, and seeded, with its rank's p99)."""

    def __init__(self, config: HangConfig) -> None:
        self.config = config
        self.history: dict[int, float] = {}  # rank -> p99 step time seen for it
        self._trackers: dict[int, tuple[int, CpuTracker]] = {}  # rank -> (pid, tracker)
        self._activity: dict[int, Activity] = {}
        self._t_sample = 0.0
        self.killed: dict[int, str] = {}  # pid -> why the agent killed it for a hang

    def sample(
        self, pids: dict[int, int], now: float, slowed: frozenset[int] = frozenset()
    ) -> dict[int, Activity]:
        """Read /proc for ``pids`` (rank -> pid) at most every 100 ms; ``slowed``: pids
        the agent's own chaos duty-cycles with SIGSTOP/SIGCONT (``slow``), not hung."""
        if now - self._t_sample < _SAMPLE_S:
            return {r: a for r, a in self._activity.items() if r in pids}
        self._t_sample = now
        activity: dict[int, Activity] = {}
        for rank, pid in pids.items():
            known = self._trackers.get(rank)
            if known is None or known[0] != pid:
                known = (pid, CpuTracker(self.config))
                self._trackers[rank] = known
            seen = read_cpu(pid)
            if seen is not None:
                state = "S" if seen[0] in ("T", "t") and pid in slowed else seen[0]
                activity[rank] = known[1].update(now, seen[1], state)
        for rank in set(self._trackers) - set(pids):
            del self._trackers[rank]
        self._activity = activity
        return activity

    def remember(self, slots: dict[int, Slot]) -> None:
        """The newest p99 each rank published (a rolling window of its recent steps)."""
        for rank, s in slots.items():
            if s.p99_s > 0:
                self.history[rank] = s.p99_s
