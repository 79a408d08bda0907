"""Where a test run's time went, by tier and by test file: the last lines ``make test``
prints (issue 26).

``--durations`` lists single tests, and CI's log keeps only its head and its tail, so
the slowest tests (the top of that list) were cut from it. This summary is a few lines
long and printed last: the time of each tier (the unit tier, the ``e2e`` tests) and the
e2e test files that took the most, each with its tests and its seconds (setup, call and
teardown together, fixtures included: a session fixture's time lands on the first test
that needs it). Wall seconds on a shared machine: compare files of one run with each
other, not runs with each other.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest

__all__ = ["TOP_FILES", "TimeByFile"]

TOP_FILES = 15
"""How many of the slowest e2e test files the summary lists."""


@dataclass
class TimeByFile:
    """Seconds per test (``add``), summed by tier and by file (``lines``)."""

    e2e: set[str] = field(default_factory=set)  # node ids of the e2e tests
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, report: pytest.TestReport) -> None:
        """A phase's report (a report's keywords carry its test's marks, under xdist too)."""
        self.seconds[report.nodeid] += report.duration
        if "e2e" in report.keywords:
            self.e2e.add(report.nodeid)

    def lines(self, top: int = TOP_FILES) -> list[str]:
        if not self.seconds:
            return []
        tiers: dict[str, list[float]] = {"unit": [0, 0.0], "e2e": [0, 0.0]}
        files: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for nodeid, secs in self.seconds.items():
            tier = tiers["e2e" if nodeid in self.e2e else "unit"]
            tier[0] += 1
            tier[1] += secs
            if nodeid in self.e2e:
                row = files[nodeid.split("::", 1)[0]]
                row[0] += 1
                row[1] += secs
        out = [f"{name} tier: {int(n)} tests, {secs:.0f} s" for name, (n, secs) in tiers.items()]
        slowest = sorted(files.items(), key=lambda kv: -kv[1][1])[:top]
        if slowest:
            out.append(f"the {len(slowest)} slowest e2e files (tests, seconds):")
        out += [f"{secs:8.0f} s {int(n):4d}  {path}" for path, (n, secs) in slowest]
        return out
