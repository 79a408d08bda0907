"""Accounting on synthetic logs whose figures were computed by hand (see conftest)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.metrics import Event, read_events
from stalwart.metrics.goodput import BUCKETS, Goodput, account

EXPECTED: dict[str, dict[str, float]] = {
    "never_failed": {"startup": 10, "productive": 19.5, "other": 2, "checkpoint_stall": 0.5},
    "single_fault": {
        "startup": 2,
        "productive": 20,
        "lost_progress": 8.5,
        "checkpoint_stall": 0.5,
        "detection": 1,
        "recovery": 2,
        "restore": 1,
        "other": 1,
    },
    "overlapping": {
        "startup": 1,
        "productive": 18,
        "lost_progress": 4.5,
        "checkpoint_stall": 0.5,
        "detection": 2,
        "recovery": 3,
        "restore": 1,
        "other": 1,
    },
    "full_restart": {
        "startup": 3,
        "productive": 20,
        "lost_progress": 10.5,
        "checkpoint_stall": 0.5,
        "detection": 0.5,
        "recovery": 6,
        "restore": 1.5,
        "other": 1,
    },
    "elastic": {
        "startup": 1,
        "productive": 32,
        "lost_progress": 0.5,
        "detection": 0.5,
        "recovery": 3.5,
        "waiting": 3,
        "other": 0.5,
    },
}
WALL = {
    "never_failed": 32,
    "single_fault": 36,
    "overlapping": 31,
    "full_restart": 43,
    "elastic": 41,
}


def _account(run: Path) -> Goodput:
    return account(read_events(str(run / "events.jsonl")).events)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_buckets_match_hand_computed_and_add_up(make_run: Any, name: str) -> None:
    g = _account(make_run(name))
    assert g.wall_s == WALL[name]
    assert g.buckets == {k: float(EXPECTED[name].get(k, 0.0)) for k in BUCKETS}
    assert math.fsum(g.buckets.values()) == g.wall_s  # exactly: a partition
    assert g.ettr == EXPECTED[name]["productive"] / WALL[name]
    assert g.problems == []


def test_never_failed(make_run: Any) -> None:
    g = _account(make_run("never_failed"))
    assert g.incidents == [] and g.resumes == [] and g.failures == []
    assert g.productive_steps == 20 and g.lost_steps == 0


def test_single_fault_rto_and_lost_work(make_run: Any) -> None:
    g = _account(make_run("single_fault"))
    (inc,) = g.incidents
    assert inc.injected and inc.t_fault == 21 and inc.t_detected == 22 and inc.t_resume == 25
    assert inc.rto_s == 4 and inc.detection_latency_s == 1 and inc.interrupted
    assert inc.restored_step == 10 and inc.steps_lost_reported == 8 and inc.strategy == "flash"
    assert g.lost_steps == 8 and g.productive_steps == 20
    assert [(r.t, r.step, r.cause) for r in g.resumes] == [(25, 11, "incident")]


def test_overlapping_incidents_and_fault_during_recovery(make_run: Any) -> None:
    g = _account(make_run("overlapping"))
    a, b = g.incidents
    assert (a.rto_s, b.rto_s) == (6, 4)
    assert a.detections == 2 and b.detections == 1  # the duplicate detection is folded in
    assert b.during_recovery and not a.during_recovery
    assert a.overlaps == [1] and b.overlaps == [0]
    assert len(g.failures) == 2 and g.lost_steps == 4


def test_full_restart_natural_fault(make_run: Any) -> None:
    g = _account(make_run("full_restart"))
    (inc,) = g.incidents
    assert not inc.injected and inc.t_fault == 24 and inc.rto_s == 8
    assert inc.strategy == "restart" and inc.source_tier == "disk"
    assert g.lost_steps == 10 and g.productive_steps == 20


def test_elastic_resizes(make_run: Any) -> None:
    g = _account(make_run("elastic"))
    assert g.world_sizes == [(0, 4), (16, 3), (30, 4)]
    assert [(r.t, r.step, r.world_size, r.cause) for r in g.resumes] == [
        (17, 11, 3, "incident"),
        (31, 21, 4, "reconfiguration"),
    ]
    assert g.incidents[0].rto_s == 5.5
    assert g.capacity_ettr == (10 * 4 + 12 * 3 + 10 * 4) / (4 * 41)


def test_detection_without_interruption_is_not_a_failure(synth: Any) -> None:
    synth.start(0.0).steps(0.0, 10.0, 1, 10, 10.0)
    synth.detect(10.0, 2.0, fault="straggler", rank=1).steps(10.0, 20.0, 11, 20, 10.0).end(20.0)
    g = _account(synth.close())
    (inc,) = g.incidents
    assert not inc.interrupted and g.failures == []
    assert g.buckets["productive"] == 20 and g.buckets["detection"] == 0


def test_a_reported_detection_has_no_rto(synth: Any) -> None:
    """A straggler reported while training goes on (steps before and after): no
    recovery ran, so there is no resumption to time (the demo printed a 9.85 s RTO)."""
    synth.start(0.0).steps(0.0, 10.0, 1, 10, 10.0).steps(10.0, 20.0, 11, 20, 10.0)
    synth.detect(15.0, 9.0, fault="straggler", rank=0).steps(20.0, 30.0, 21, 30, 10.0).end(30.0)
    (inc,) = _account(synth.close()).incidents
    assert not inc.interrupted and inc.t_resume is None and inc.rto_s is None


def test_run_ending_during_recovery(synth: Any) -> None:
    synth.start(0.0).steps(0.0, 10.0, 1, 10, 10.0)
    synth.fault(10.0, rank=0).detect(11.0, 1.0, rank=0).rec_begin(11.0, 2).end(15.0, "failed")
    g = _account(synth.close())
    (inc,) = g.incidents
    assert inc.interrupted and inc.t_resume is None and inc.rto_s is None
    assert g.buckets["detection"] == 1 and g.buckets["recovery"] == 4


def test_stall_counted_once_when_every_rank_reports_it(synth: Any) -> None:
    synth.start(0.0).steps(0.0, 10.0, 1, 10, 10.0)
    for rank in range(4):
        synth.emit("snapshot", 11.0, step=10, stall_s=1.0, rank=rank)
    synth.steps(11.0, 21.0, 11, 20, 10.0).end(21.0)
    g = _account(synth.close())
    assert g.buckets["checkpoint_stall"] == 1 and math.fsum(g.buckets.values()) == 21


def test_no_events_is_an_error() -> None:
    with pytest.raises(ValueError, match="no events"):
        account([])


def test_batch_flushed_at_recovery_gives_its_idle_tail_to_the_incident(synth: Any) -> None:
    # The launcher's survivors flush their step batch when they notice the failure: the
    # batch [10, 14] holds 2 s of compute; its idle tail [12, 14] was lost work in flight
    # until the fault (12.5), then detection (to 13.5), then recovery.
    synth.start(0.0).steps(0.0, 10.0, 1, 10, 10.0).steps(10.0, 14.0, 11, 12, 2.0)
    synth.fault(12.5, rank=2).detect(13.5, 1.0, rank=2).rec_begin(13.5, 2)
    synth.restore(15.0, 10, 0.5).rec_end(15.5, 2, restored=10, lost=2)
    synth.steps(16.0, 26.0, 11, 20, 10.0).end(26.0)
    g = _account(synth.close())
    assert g.buckets == {
        **dict.fromkeys(BUCKETS, 0.0),
        "productive": 20,
        "lost_progress": 2.5,
        "detection": 1,
        "recovery": 2,
        "restore": 0.5,
    }
    assert g.incidents[0].rto_s == 3.5 and g.lost_steps == 2


def test_node_fault_without_rank_matches_the_rank_detections(synth: Any) -> None:
    synth.start(0.0).steps(0.0, 10.0, 1, 10, 10.0)
    synth.emit("fault_injected", 10.0, fault="node_kill", domain={"rank": None, "node": 1})
    synth.detect(10.5, 0.5, rank=2, node=1).detect(10.6, 0.6, rank=3, node=1)
    synth.rec_begin(10.6, 2).rec_end(12.0, 2, restored=10, lost=0)
    synth.steps(12.0, 22.0, 11, 20, 10.0).end(22.0)
    g = _account(synth.close())
    (inc,) = g.incidents
    assert inc.injected and inc.detections == 2 and inc.rto_s == 2


@st.composite
def _random_log(draw: st.DrawFn) -> list[Event]:
    """A plausible but random run: batches, stalls, faults, recoveries, waits, resizes."""
    events: list[Event] = []
    t, step, gen = 0.0, 0, 1

    def ev(kind: str, when: float, **f: Any) -> None:
        events.append(Event(kind, when, "h", 1, 0, None, f))

    ev("run_start", 0.0, job="j", world_size=4)
    for _ in range(draw(st.integers(0, 12))):
        action = draw(st.sampled_from(["steps", "steps", "snapshot", "fault", "wait", "gap"]))
        dt = draw(st.floats(0.01, 5.0))
        if action == "steps":
            n = draw(st.integers(1, 5))
            busy = dt * draw(st.floats(0.0, 1.2))
            ev(
                "steps",
                t + dt,
                first_step=step + 1,
                last_step=step + n,
                count=n,
                busy_s=busy,
                t_first_start=t,
                generation=gen,
            )
            step += n
        elif action == "snapshot":
            ev("snapshot", t + dt, step=step, stall_s=dt * draw(st.floats(0.0, 1.5)))
        elif action == "fault":
            ev("fault_injected", t, fault="kill", domain={"rank": 1})
            if draw(st.booleans()):
                ev(
                    "fault_detected",
                    t + dt,
                    fault="crash",
                    domain={"rank": 1},
                    latency_s=draw(st.floats(0.0, 2 * dt)),
                )
            gen += 1
            ev("recovery_begin", t + dt, strategy="flash", generation=gen)
            if draw(st.booleans()):
                ev("restore", t + 1.5 * dt, step=step, tier="memory", seconds=dt)
            back = draw(st.integers(0, step))
            ev(
                "recovery_end",
                t + 2 * dt,
                strategy="flash",
                generation=gen,
                restored_step=back,
                steps_lost=step - back,
            )
            step = back
            dt *= 2
        elif action == "wait":
            ev("waiting", t, have=3, need=4)
            ev("resize", t + dt, world_size=draw(st.integers(1, 4)))
        t += dt
    if draw(st.booleans()):
        ev("run_end", t + draw(st.floats(0.0, 2.0)), status="ok")
    events.sort(key=lambda e: e.t)
    return events


@settings(max_examples=150, deadline=None, database=None)
@given(_random_log())
def test_buckets_always_partition_the_wall_time(events: list[Event]) -> None:
    g = account(events)
    assert all(v >= 0 for v in g.buckets.values()), g.buckets
    assert math.fsum(g.buckets.values()) == pytest.approx(g.wall_s, rel=1e-9, abs=1e-9)
    busy = math.fsum(float(e["busy_s"]) for e in events if e.kind == "steps")
    assert g.buckets["productive"] <= busy + 1e-9
    for i in g.incidents:
        assert i.rto_s is None or i.rto_s >= 0


def test_run_end_before_run_start_is_a_problem_not_a_negative_wall(synth: Any) -> None:
    synth.start(10.0).end(9.0)
    g = _account(synth.close())
    assert g.wall_s == 0 and g.problems and "clock skew" in g.problems[0]


def test_wall_time_runs_from_the_launch_and_the_agents_start_up_is_startup(
    synth: Any,
) -> None:
    """run_start comes once the zygote is ready (12-20 s of imports for a transformers
    script): the wall time starts at its launch_t, and that time is startup."""
    s = synth.emit("run_start", 10.0, job="j", world_size=4, strategy="flash", launch_t=4.0)
    g = account(
        read_events(str(s.steps(12.0, 20.0, 1, 8, 8.0).end(20.0).close() / "events.jsonl")).events
    )
    assert g.t_start == 4.0 and g.wall_s == 16.0
    assert g.buckets["startup"] == 8.0 and g.buckets["productive"] == 8.0
    assert math.fsum(g.buckets.values()) == g.wall_s
    assert g.ettr == 0.5  # productive over the wall time from the launch


def test_a_launch_time_after_run_start_is_not_believed(synth: Any) -> None:
    s = synth.emit("run_start", 10.0, job="j", world_size=4, strategy="flash", launch_t=11.0)
    g = account(
        read_events(str(s.steps(12.0, 20.0, 1, 8, 8.0).end(20.0).close() / "events.jsonl")).events
    )
    assert g.t_start == 10.0 and g.wall_s == 10.0
