"""chaos/inject.py: one way to fire a worker-side fault, for the runtime and plain scripts."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from _load import scaled

from stalwart.chaos import FaultPlan
from stalwart.chaos.inject import inject


def _fault(spec: str) -> Any:
    return FaultPlan.parse(spec).faults[0]


def test_a_slow_fault_is_recorded_then_handed_to_the_slow_callback() -> None:
    fault = _fault("slow rank=1 factor=3 at=step:4 for=2s")
    events: list[tuple[str, dict[str, Any]]] = []
    slowed: list[Any] = []
    inject(fault, {"rank": 1, "node": 0}, lambda k, **f: events.append((k, f)), slowed.append)
    assert slowed == [fault]
    assert events == [
        ("fault_injected", {"fault": "slow", "domain": {"rank": 1, "node": 0}, "spec": fault.text})
    ]


def test_without_a_log_the_fault_still_fires() -> None:
    slowed: list[Any] = []
    inject(
        _fault("slow rank=0 factor=2 at=step:1 for=1s"), {"rank": 0, "node": 0}, None, slowed.append
    )
    assert len(slowed) == 1


def test_kill_is_a_sigkill_of_this_process() -> None:
    code = (
        "from stalwart.chaos import FaultPlan; from stalwart.chaos.inject import inject; "
        "f = FaultPlan.parse('kill rank=0 at=step:1').faults[0]; "
        "say = lambda *a, **k: print(*a, flush=True); "
        "inject(f, {'rank': 0, 'node': 0}, say, say); print('survived', flush=True)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60)
    )
    assert proc.returncode == -9 and "survived" not in proc.stdout
    assert "fault_injected" in proc.stdout  # recorded before it fired


def test_corrupt_and_nan_go_to_the_tamper_callback_and_the_event_says_what_changed() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    slowed: list[Any] = []
    tampered: list[Any] = []

    def tamper(fault: Any) -> str:
        tampered.append(fault)
        return "tensor 0 element 3 bit 7"

    emit = lambda k, **f: events.append((k, f))  # noqa: E731
    for spec in ("corrupt rank=0 at=step:2", "nan rank=0 at=step:3"):
        inject(_fault(spec), {"rank": 0, "node": 0}, emit, slowed.append, tamper)
    assert slowed == [] and len(tampered) == 2
    assert [f["spec"].endswith("(tensor 0 element 3 bit 7)") for _, f in events] == [True, True]


def test_corrupt_without_tracked_state_fires_nothing_and_says_so() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    slowed: list[Any] = []
    fault = _fault("corrupt rank=0 at=step:2")
    inject(fault, {"rank": 0, "node": 0}, lambda k, **f: events.append((k, f)), slowed.append)
    assert slowed == []
    assert events[0][1]["spec"] == f"{fault.text} (not fired: no tracked state)"
