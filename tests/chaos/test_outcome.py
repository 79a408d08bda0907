"""unmet_faults: the check that a faulted run met its faults, on hand-written event logs."""

from __future__ import annotations

from typing import Any

from stalwart.chaos import unmet_faults

_SPEC = "kill rank=1 at=time:3s; corrupt rank=0 at=step:4; hang rank=0 at=step:9"


def _start(spec: str = _SPEC) -> tuple[str, dict[str, Any]]:
    return "run_start", {"job": "j", "world_size": 2, "config": {"chaos": spec}}


def _fired(spec: str) -> tuple[str, dict[str, Any]]:
    return "fault_injected", {"fault": spec.split()[0], "domain": {"rank": 1}, "spec": spec}


def test_a_run_that_met_every_fault_has_nothing_unmet() -> None:
    events = [
        _start(),
        _fired("kill rank=1 at=time:3s"),
        _fired("corrupt rank=0 at=step:4 (flipped bit 3 of param 0 elem 7)"),  # what it did
        _fired("hang rank=0 at=step:9"),
    ]
    assert unmet_faults(events) == []


def test_a_fault_past_the_end_of_the_job_is_named_with_the_agents_reason() -> None:
    why = "the job ended first, 2.4 s after the first step, before the fault's 3 s"
    events = [
        _start(),
        _fired("corrupt rank=0 at=step:4 (flipped bit 3 of param 0 elem 7)"),
        _fired("hang rank=0 at=step:9"),
        ("fault_unfired", {"spec": "kill rank=1 at=time:3s", "reason": why}),
    ]
    assert unmet_faults(events) == [f"chaos fault 'kill rank=1 at=time:3s' never fired: {why}"]


def test_a_run_cut_short_has_no_reason_and_says_that() -> None:
    (line,) = unmet_faults([_start("kill rank=1 at=time:3s")])
    assert line.startswith("chaos fault 'kill rank=1 at=time:3s' never fired: no fault_injected")
    assert "killed or timed out" in line


def test_a_queued_fault_that_never_fired_is_named_too() -> None:
    events = [_start(), *(_fired(t) for t in _SPEC.split("; "))]
    events.append(("fault_unfired", {"spec": "kill rank=0 at=time:0s", "reason": "the job ended"}))
    assert unmet_faults(events) == [
        "chaos fault 'kill rank=0 at=time:0s' never fired: the job ended"
    ]


def test_a_run_without_chaos_met_everything() -> None:
    assert unmet_faults([("run_start", {"job": "j", "world_size": 1, "config": {}})]) == []
    assert unmet_faults([]) == []
