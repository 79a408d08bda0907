"""The run's closing summary of time by tier and by e2e file (tests/_timing.py)."""

from __future__ import annotations

import pytest
from _timing import TimeByFile


def _report(nodeid: str, secs: float, *, e2e: bool, when: str = "call") -> pytest.TestReport:
    keywords = {"e2e": 1} if e2e else {}
    return pytest.TestReport(nodeid, (nodeid, 0, ""), keywords, "passed", None, when, [], secs)


def test_time_is_summed_per_tier_and_the_slowest_e2e_files_come_first() -> None:
    times = TimeByFile()
    for rep in [
        _report("tests/a/test_x.py::test_one", 0.5, e2e=False),
        _report("tests/a/test_job.py::test_one", 30.0, e2e=True, when="setup"),
        _report("tests/a/test_job.py::test_one", 10.0, e2e=True),
        _report("tests/a/test_job.py::test_two", 20.0, e2e=True),
        _report("tests/b/test_big.py::test_cell[a]", 70.0, e2e=True),
    ]:
        times.add(rep)
    assert times.lines(top=1) == [
        "unit tier: 1 tests, 0 s",
        "e2e tier: 3 tests, 130 s",
        "the 1 slowest e2e files (tests, seconds):",
        "      70 s    1  tests/b/test_big.py",
    ]
    assert times.lines()[-1] == "      60 s    2  tests/a/test_job.py"


def test_a_run_of_no_tests_prints_nothing() -> None:
    assert TimeByFile().lines() == []
