"""A writer of synthetic event logs with explicit times, valid by construction (every
event goes through EventLog.emit), so the expected figures can be computed by hand."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.metrics import EventLog


class Synth:
    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.log = EventLog(str(run_dir / "events.jsonl"), node=0)

    def emit(self, kind: str, t: float, **fields: Any) -> Synth:
        self.log.emit(kind, t=t, **fields)
        return self

    def start(self, t: float, ws: int = 4, strategy: str = "flash") -> Synth:
        return self.emit("run_start", t, job="synthetic", world_size=ws, strategy=strategy)

    def end(self, t: float, status: str = "ok") -> Synth:
        return self.emit("run_end", t, status=status)

    def steps(
        self, t0: float, t1: float, first: int, last: int, busy: float, gen: int = 1
    ) -> Synth:
        return self.emit(
            "steps",
            t1,
            first_step=first,
            last_step=last,
            count=last - first + 1,
            busy_s=busy,
            t_first_start=t0,
            generation=gen,
        )

    def snapshot(self, t: float, step: int, stall: float) -> Synth:
        return self.emit("snapshot", t, step=step, stall_s=stall, bytes=1 << 20, tier="memory")

    def persist(self, t0: float, t1: float, step: int, ok: bool = True) -> Synth:
        self.emit("persist_begin", t0, step=step)
        return self.emit(
            "persist_end",
            t1,
            step=step,
            ok=ok,
            seconds=t1 - t0,
            bytes_written=1 << 20,
            total_bytes=1 << 20,
        )

    def fault(self, t: float, **domain: int) -> Synth:
        return self.emit("fault_injected", t, fault="kill", domain=domain, spec="test")

    def detect(self, t: float, latency: float, fault: str = "crash", **domain: int) -> Synth:
        return self.emit(
            "fault_detected", t, fault=fault, domain=domain, latency_s=latency, how="exit"
        )

    def rec_begin(self, t: float, gen: int, strategy: str = "flash") -> Synth:
        return self.emit("recovery_begin", t, strategy=strategy, generation=gen, cause="fault")

    def rec_end(self, t: float, gen: int, restored: int, lost: int, tier: str = "memory") -> Synth:
        return self.emit(
            "recovery_end",
            t,
            strategy="flash",
            generation=gen,
            restored_step=restored,
            steps_lost=lost,
            source_tier=tier,
            ok=True,
        )

    def restore(self, t: float, step: int, seconds: float, tier: str = "memory") -> Synth:
        return self.emit("restore", t, step=step, tier=tier, seconds=seconds)

    def close(self) -> Path:
        self.log.close()
        return self.dir


@pytest.fixture
def synth(tmp_path: Path) -> Iterator[Synth]:
    s = Synth(tmp_path / "run")
    yield s
    s.close()


# Scenarios with hand-computed figures (docs/goodput.md walks through the first two).
# Times are binary fractions so that the expected sums are exact in floating point.


def never_failed(s: Synth) -> None:
    # startup [0,10]; steps 1..10 in [10,20] busy 9.5; stall [20,20.5]; steps 11..20 in
    # [20.5,30.5]; persist [20.5,25] in the background; shutdown [30.5,32] is "other".
    s.start(0.0).steps(10.0, 20.0, 1, 10, 9.5).snapshot(20.5, 10, 0.5)
    s.persist(20.5, 25.0, 10).steps(20.5, 30.5, 11, 20, 10.0).end(32.0)


def single_fault(s: Synth) -> None:
    s.start(0.0).steps(2.0, 12.0, 1, 10, 10.0).snapshot(12.5, 10, 0.5)
    s.steps(12.5, 20.5, 11, 18, 8.0)  # rolled back below: lost work
    s.fault(21.0, rank=2, node=0)  # [20.5,21] steps done but never recorded: lost
    s.detect(22.0, 1.0, rank=2).rec_begin(22.0, 2)  # detection [21,22]
    s.restore(24.0, 10, 1.0).rec_end(24.5, 2, restored=10, lost=8)  # restore [23,24]
    s.steps(25.0, 33.0, 11, 18, 8.0).steps(33.0, 35.0, 19, 20, 2.0).end(36.0)


def overlapping(s: Synth) -> None:
    s.start(0.0).steps(1.0, 11.0, 1, 10, 10.0).snapshot(11.5, 10, 0.5)
    s.steps(11.5, 15.5, 11, 14, 4.0)
    s.fault(16.0, rank=1).detect(17.0, 1.0, rank=1).rec_begin(17.0, 2)
    s.detect(17.5, 1.5, rank=1)  # a second detector saw the same fault
    s.fault(18.0, rank=3).detect(19.0, 1.0, rank=3).rec_begin(19.0, 3)  # during recovery
    s.restore(21.0, 10, 1.0).rec_end(22.0, 3, restored=10, lost=4)
    s.steps(22.0, 30.0, 11, 18, 8.0).end(31.0)


def full_restart(s: Synth) -> None:
    s.start(0.0, ws=2, strategy="restart")
    for r in (0, 1):
        s.emit("member_join", 0.5, member=f"w{r}", node=0, rank=r, generation=1)
    s.emit("generation", 1.0, generation=1, world_size=2, reason="start")
    s.steps(3.0, 13.0, 1, 10, 10.0).snapshot(13.5, 10, 0.5).persist(13.5, 15.5, 10)
    s.steps(13.5, 23.5, 11, 20, 10.0)
    s.detect(24.5, 0.5, rank=0, node=0)  # natural crash, no injection: fault at 24.0
    s.rec_begin(24.5, 2, "restart")
    for r in (0, 1):
        s.emit("member_leave", 25.0, member=f"w{r}", node=0, rank=r, reason="restart")
    for r in (0, 1):
        s.emit("member_join", 28.0, member=f"w{r}", node=0, rank=r, generation=2)
    s.emit("generation", 29.0, generation=2, world_size=2, reason="restart")
    s.restore(31.0, 10, 1.5, "disk").rec_end(31.5, 2, restored=10, lost=10, tier="disk")
    s.steps(32.0, 42.0, 11, 20, 10.0).end(43.0)


def elastic(s: Synth) -> None:
    s.start(0.0, ws=4, strategy="elastic").steps(1.0, 11.0, 1, 10, 10.0)
    s.fault(11.5, node=1, rank=3).detect(12.0, 0.5, node=1).rec_begin(12.0, 2, "elastic")
    s.emit("waiting", 12.5, have=3, need=4, reason="replacement")
    s.emit("waiting", 15.5, have=3, need=3, reason="shrink")
    s.emit("generation", 16.0, generation=2, world_size=3, reason="shrink")
    s.emit("resize", 16.0, world_size=3, micro_batches=4, global_batch=48)
    s.rec_end(16.5, 2, restored=10, lost=0)
    s.steps(17.0, 29.0, 11, 20, 12.0, gen=2)
    s.emit("member_join", 29.5, member="n1", node=1, rank=3, generation=3)
    s.rec_begin(29.5, 3, "elastic")
    s.emit("generation", 30.0, generation=3, world_size=4, reason="grow")
    s.emit("resize", 30.0, world_size=4, micro_batches=3, global_batch=48)
    s.rec_end(30.5, 3, restored=20, lost=0)
    s.steps(31.0, 41.0, 21, 30, 10.0, gen=3).end(41.0)


SCENARIOS = {
    "never_failed": never_failed,
    "single_fault": single_fault,
    "overlapping": overlapping,
    "full_restart": full_restart,
    "elastic": elastic,
}


@pytest.fixture
def make_run(tmp_path: Path) -> Iterator[Any]:
    made: list[Synth] = []

    def make(name: str, sub: str = "run", extra: Any = None) -> Path:
        s = Synth(tmp_path / sub)
        made.append(s)
        SCENARIOS[name](s)
        if extra is not None:
            extra(s)
        return s.close()

    yield make
    for s in made:
        s.close()
