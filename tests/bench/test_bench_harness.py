"""bench/_harness.py: medians and spread over repetitions, and when a figure is invalid
(a failed repetition, a fault-trace run short of its faults, the load jumping within a
pair), in process with a scripted measure and load."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _loads(*values: float) -> Callable[[], float]:
    it: Iterator[float] = iter(values)
    return lambda: next(it)


def _run(
    harness: ModuleType,
    figures: list[Mapping[str, Any] | Exception],
    loads: tuple[float, ...] | None = None,
) -> Any:
    def measure(rep: int) -> Mapping[str, Any]:
        got = figures[rep]
        if isinstance(got, Exception):
            raise got
        return got

    load = _loads(*(loads or (3.0,) * (2 * len(figures))))
    return harness.repeat(measure, len(figures), load=load, log=lambda line: None, outside=None)


def test_median_min_max_per_nested_figure(harness: ModuleType) -> None:
    reps = [
        {"rto_s": 1.0, "routes": {"flash": {"ettr": 0.9}}, "note": "a"},
        {"rto_s": 3.0, "routes": {"flash": {"ettr": 0.7}}, "note": "b"},
        {"rto_s": 2.0, "routes": {"flash": {"ettr": 0.8}}, "note": "c"},
    ]
    doc = _run(harness, reps).document()
    assert doc["rto_s"] == 2.0 and doc["routes"]["flash"]["ettr"] == 0.8
    assert doc["spread"]["rto_s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "valid": True}
    assert doc["spread"]["routes.flash.ettr"]["min"] == 0.7
    assert doc["note"] == "c"  # not a number: the last repetition's
    counts = _run(harness, [{"faults": 5}, {"faults": 7}, {"faults": 6}]).document()
    assert counts["faults"] == 6 and isinstance(counts["faults"], int)
    assert doc["valid"] is True and doc["invalid"] == [] and doc["reps"] == 3
    assert [x["rep"] for x in doc["load"]] == [0, 1, 2]
    assert doc["versions"]["etcd"] == "3.5-test" and "torch" in doc["versions"]
    assert doc["machine"]["cores"] >= 1


def test_a_figure_the_bench_repeated_itself_has_its_samples_spread(harness: ModuleType) -> None:
    """bench/checkpoint.py takes its pairs inside one harness repetition: the table's
    min, max and n are the pairs', not n = 1."""
    persist = harness.Sampled([0.9, 0.7, 0.8])
    assert persist == 0.8  # reads as the median
    doc = _run(harness, [{"persist_s": persist, "gbps": 2.0 / persist}]).document()
    assert doc["persist_s"] == 0.8
    assert doc["spread"]["persist_s"] == {
        "median": 0.8, "min": 0.7, "max": 0.9, "n": 3, "valid": True,
    }  # fmt: skip
    assert doc["spread"]["gbps"]["n"] == 1  # a figure derived from it is one number
    with pytest.raises(ValueError, match="at least one sample"):
        harness.Sampled([])


def test_a_failed_repetition_invalidates_and_the_rest_still_run(harness: ModuleType) -> None:
    summary = _run(harness, [{"x": 1.0}, RuntimeError("worker died"), {"x": 3.0}])
    doc = summary.document()
    assert doc["valid"] is False
    assert any("repetition 1 failed" in r and "worker died" in r for r in doc["invalid"])
    assert doc["spread"]["x"]["n"] == 2 and doc["x"] == 2.0
    assert summary.figure("x") is None  # no verdict from it


def test_fault_shortfall_invalidates_only_its_figures(harness: ModuleType) -> None:
    short = harness.fault_shortfall("routes.flash", 2, 5)
    assert harness.fault_shortfall("routes.spare", 5, 5) is None
    reps = [{"routes": {"flash": {"ettr": 0.9}, "spare": {"ettr": 0.8}}, "_invalid": [short]}]
    summary = _run(harness, reps)
    assert summary.figure("routes.flash.ettr") is None
    assert summary.figure("routes.spare.ettr") == 0.8
    doc = summary.document()
    assert doc["valid"] is False and "met 2 faults" in doc["invalid"][0]
    assert doc["spread"]["routes.flash.ettr"]["valid"] is False
    assert doc["spread"]["routes.spare.ettr"]["valid"] is True
    assert "_invalid" not in doc


def test_unknown_fault_count_is_a_shortfall(harness: ModuleType) -> None:
    assert harness.fault_shortfall("r", None, 1) is not None


@pytest.mark.parametrize(
    ("before", "after", "valid"),
    [(3.0, 7.0, False), (7.0, 3.0, False), (3.0, 5.0, True), (0.1, 0.6, True), (0.2, 2.5, False)],
)
def test_load_jump_within_a_pair(
    harness: ModuleType, before: float, after: float, valid: bool
) -> None:
    summary = _run(harness, [{"x": 1.0}], loads=(before, after))
    assert summary.document()["valid"] is valid
    assert (summary.figure("x") is not None) is valid


def test_interleaved_reverses_every_other_repetition(harness: ModuleType) -> None:
    arms = ["ours", "peer", "floor"]
    assert harness.interleaved(arms, 0) == arms
    assert harness.interleaved(arms, 1) == ["floor", "peer", "ours"]
    assert harness.interleaved(arms, 2) == arms


def test_reps_must_be_positive(harness: ModuleType) -> None:
    with pytest.raises(ValueError, match="--reps"):
        harness.repeat(lambda rep: {}, 0)


def test_extra_verdicts_ride_on_top(harness: ModuleType) -> None:
    doc = _run(harness, [{"x": 1.0}]).document({"best": "flash"})
    assert doc["best"] == "flash" and doc["x"] == 1.0


class _Halves:
    """A scripted outside-load sampler: the halves it reports."""

    def __init__(self, halves: tuple[float, float] | None) -> None:
        self.halves = halves

    def start(self) -> _Halves:
        return self

    def stop(self) -> tuple[float, float] | None:
        return self.halves


def test_the_bench_s_own_load_is_not_a_jump_and_outside_load_is(harness: ModuleType) -> None:
    """The load average went 1.8 -> 5.5 on a quiet machine from the bench's own workers:
    a fair pair; another job starting halfway through (0.2 -> 3.1 runnable threads
    outside the bench) is not, whatever the load average says."""
    quiet = harness.repeat(
        lambda rep: {"x": 1.0},
        1,
        load=_loads(1.8, 5.5),
        log=lambda line: None,
        outside=lambda: _Halves((0.3, 0.5)),
    )
    assert quiet.document()["valid"] is True
    assert quiet.document()["load"][0]["outside"] == [0.3, 0.5]
    busy = harness.repeat(
        lambda rep: {"x": 1.0},
        1,
        load=_loads(4.0, 4.0),
        log=lambda line: None,
        outside=lambda: _Halves((0.2, 3.1)),
    )
    doc = busy.document()
    assert doc["valid"] is False and busy.figure("x") is None
    assert "outside the bench went 0.2 -> 3.1" in doc["invalid"][0]


def test_runnable_outside_counts_threads_not_in_the_bench_tree(tmp_path: Path) -> None:
    import _outside_load

    def proc(pid: int, ppid: int, tasks: dict[int, str]) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a (b) c) S {ppid} 1 1\n")
        for tid, state in tasks.items():
            task = tmp_path / str(pid) / "task" / str(tid)
            task.mkdir(parents=True)
            task.joinpath("stat").write_text(f"{tid} (a (b) c) {state} {ppid} 1 1\n")

    proc(100, 1, {100: "R", 105: "R"})  # the bench: not counted
    proc(101, 100, {101: "R"})  # its worker
    proc(102, 101, {102: "D"})  # the worker's child
    proc(200, 1, {200: "R", 201: "S", 202: "D"})  # another job: two count
    proc(300, 1, {300: "S"})  # an idle daemon
    (tmp_path / "self").mkdir()  # not a process
    assert _outside_load.runnable_outside(100, str(tmp_path)) == 2
    assert _outside_load.runnable_outside(200, str(tmp_path)) == 4  # 100, 105, 101, 102
