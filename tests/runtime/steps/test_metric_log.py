"""sess.log values as sampled events (runtime/steps/_metric_log.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stalwart.metrics import EventLog, read_events
from stalwart.metrics.convergence import loss_curve
from stalwart.runtime.steps._metric_log import MetricLog


class Lazy:
    """A tensor-like value that counts how often it was read."""

    reads = 0

    def __init__(self, v: float) -> None:
        self.v = v

    def detach(self) -> Lazy:
        return self

    def item(self) -> float:
        Lazy.reads += 1
        return self.v


def _log(tmp_path: Path, **kw: Any) -> tuple[MetricLog, EventLog]:
    ev = EventLog(str(tmp_path / "events.jsonl"), node=0, rank=0)
    return MetricLog(ev, **kw), ev


def _kinds(tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
    res = read_events(str(tmp_path / "events.jsonl"))
    assert not res.problems, res.problems
    return [(e.kind, e.fields) for e in res.events]


def test_dense_first_then_bounded_rate_and_always_the_last(tmp_path: Path) -> None:
    m, ev = _log(tmp_path, first=5, after_resume=0, interval_s=10.0)
    t = 100.0
    for step in range(1, 51):
        m.log({"loss": 1.0 / step, "lr": 0.1})
        m.step_done(step, generation=0, now=t)
        t += 1.0  # one step a second: after the first 5, one in 10 is written
    m.flush()
    ev.close()
    curve = loss_curve([e for e in read_events(str(tmp_path / "events.jsonl")).events])
    assert sorted(curve)[:5] == [1, 2, 3, 4, 5]
    assert 50 in curve  # the last step, written by flush
    assert len(curve) < 12
    assert curve[50] == 1.0 / 50
    lrs = [f for k, f in _kinds(tmp_path) if k == "metric"]
    assert {f["name"] for f in lrs} == {"lr"} and len(lrs) == len(curve)


def test_after_a_recovery_the_next_steps_are_dense_again(tmp_path: Path) -> None:
    m, ev = _log(tmp_path, first=2, after_resume=3, interval_s=1e9)
    for step in range(1, 11):
        m.log({"loss": float(step)})
        m.step_done(step, 0, now=0.0)
    m.log({"loss": -1.0})  # a failed step's value: dropped
    m.recovered()
    for step in range(6, 12):
        m.log({"loss": float(step) + 0.5})
        m.step_done(step, 1, now=0.0)
    ev.close()
    steps = [(f["step"], f["generation"]) for k, f in _kinds(tmp_path) if k == "loss"]
    # the start counts as a resumption too
    assert steps == [(1, 0), (2, 0), (3, 0), (6, 1), (7, 1), (8, 1)]


def test_values_are_read_only_when_written(tmp_path: Path) -> None:
    Lazy.reads = 0
    m, ev = _log(tmp_path, first=1, after_resume=0, interval_s=1e9)
    for step in range(1, 101):
        m.log({"loss": Lazy(float(step))})
        m.step_done(step, 0, now=0.0)
    m.flush()
    ev.close()
    assert Lazy.reads == 2  # step 1 and the last


def test_non_finite_and_non_numbers_are_noted_once_not_written(tmp_path: Path) -> None:
    m, ev = _log(tmp_path)
    for step in (1, 2):
        m.log({"loss": float("nan"), "name": "abc"})
        m.step_done(step, 0)
    ev.close()
    kinds = _kinds(tmp_path)
    assert not [k for k, _ in kinds if k in ("loss", "metric")]
    notes = [f["message"] for k, f in kinds if k == "note"]
    assert len(notes) == 2 and any("nan" in n for n in notes)


def test_without_an_event_log_nothing_is_kept() -> None:
    m = MetricLog(None)
    m.log({"loss": 1.0})
    m.step_done(1, 0)
    assert m.pending == {}
