"""The integrity checks in-process: digests, the majority split, the spike watch, the
chaos faults on a replica's tensors, and a rollback decided from exchanged numbers."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stalwart.chaos import ChaosSpecError, Fault, FaultPlan
from stalwart.contract.env import WorkerEnv
from stalwart.runtime.integrity._checks import Integrity, NumericalFaultError
from stalwart.runtime.integrity._digest import (
    flip_bit,
    majority_split,
    poison,
    replicated_tensors,
    state_digest,
)
from stalwart.runtime.integrity._spikes import Reading, SpikeWatch


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(7, 5), torch.randn(3), torch.tensor(4.0)]


def test_any_single_bit_flip_changes_the_digest() -> None:
    tensors = _tensors()
    before = state_digest(tensors)
    assert before == state_digest([t.clone() for t in tensors])
    for fid in range(40):
        copy = [t.clone() for t in tensors]
        flip_bit(copy, Fault(fid, "corrupt", "corrupt rank=0 at=step:1", rank=0), fid)
        assert state_digest(copy) != before, fid


def test_the_flip_is_the_same_in_every_run_and_can_be_pinned_down() -> None:
    fault = Fault(3, "corrupt", "x", rank=0, at_step=9)
    a, b = _tensors(), _tensors()
    assert flip_bit(a, fault, 9) == flip_bit(b, fault, 9)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    pinned = Fault(3, "corrupt", "x", rank=0, at_step=9, param=1, elem=2, bit=31)
    c = _tensors()
    assert flip_bit(c, pinned, 9) == "tensor 1 element 2 bit 31"
    assert c[1][2] == -_tensors()[1][2]  # the sign bit


def test_poison_sets_a_nan() -> None:
    tensors = _tensors()
    poison(tensors)
    assert math.isnan(float(tensors[0].reshape(-1)[0]))


def test_majority_split() -> None:
    assert majority_split([5, 5, 5]) == (5, [])
    assert majority_split([5, 9, 5]) == (5, [1])
    assert majority_split([5, 9]) == (None, [0, 1])  # two replicas: no majority
    assert majority_split([1, 2, 3, 3]) == (None, [0, 1, 2, 3])


def test_spike_watch_flags_nonfinite_and_upward_spikes_only() -> None:
    watch = SpikeWatch(z=6.0, window=50)
    for i in range(30):
        assert watch.judge(2.0 + 0.01 * (i % 5)) == Reading.OK
    assert watch.judge(float("nan")) == Reading.NONFINITE
    assert watch.judge(float("inf")) == Reading.NONFINITE
    assert watch.judge(9.0) == Reading.SPIKE
    assert watch.last_z > 6.0
    assert watch.judge(0.5) == Reading.OK  # a drop is training, not a fault
    off = SpikeWatch(z=0.0, window=50)
    for _ in range(30):
        off.judge(1.0)
    assert off.judge(1e9) == Reading.OK


def test_the_spec_takes_corrupt_and_nan_step_keyed_on_a_rank() -> None:
    plan = FaultPlan.parse("corrupt rank=1 at=step:7 bit=3; nan rank=0 at=step:9")
    assert [(f.kind, f.rank, f.at_step, f.bit) for f in plan.faults] == [
        ("corrupt", 1, 7, 3),
        ("nan", 0, 9, None),
    ]
    assert FaultPlan.from_json(plan.to_json()) == plan
    bad_specs = (
        "corrupt rank=1 at=time:5s",
        "nan node=0 at=step:3",
        "corrupt rank=0 at=step:2 bit=64",
    )
    for bad in bad_specs:
        with pytest.raises(ChaosSpecError):
            FaultPlan.parse(bad)


def test_replicated_tensors_are_parameters_then_optimizer_state() -> None:
    from stalwart.runtime.comm.group import ensure_local_default_group

    ensure_local_default_group()
    model = torch.nn.Linear(3, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters())
    ddp(torch.ones(1, 3)).sum().backward()
    opt.step()
    found = replicated_tensors({"model": ddp, "opt": opt, "rng": object()})
    assert len(found) == 2 + 2 * 3  # weight, bias; step, exp_avg, exp_avg_sq each


class _Snaps:
    """Snapshot slots as a dict step -> state copy (what the checks use of them)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.held: dict[int, torch.Tensor] = {}
        self.pinned: list[int] = []

    def take(self, step: int) -> None:
        self.held[step] = self.state["w"].clone()

    def steps(self) -> list[int]:
        return sorted(self.held)

    def restore(self, state: dict[str, Any], *, step: int) -> int:
        state["w"].copy_(self.held[step])
        return step

    def discard_newer(self, step: int) -> None:
        self.held = {s: v for s, v in self.held.items() if s <= step or s in self.pinned}

    def pin_latest(self, wait: bool = True) -> tuple[int, Any]:
        step = max(self.held)
        self.pinned.append(step)
        return step, SimpleNamespace(step=step)

    def unpin(self, slot: int) -> None:
        self.pinned.remove(slot)

    def after_copy(self, fn: Any) -> None:
        fn(None)

    def wait(self) -> float:
        return 0.0


def _integrity(exchange: list[int], **env: Any) -> tuple[Integrity, dict[str, Any], _Snaps]:
    state = {"w": torch.zeros(4)}
    snaps = _Snaps(state)
    tracked = SimpleNamespace(state=state, snapshots=snaps, replicated=True, opened=True)

    def allreduce_(flat: torch.Tensor) -> None:
        if flat.numel() == len(exchange):  # the per-step exchange: the ranks' numbers
            flat.copy_(torch.tensor(exchange, dtype=torch.int64))
        else:  # the rollback target's: rank 1 holds the same steps as rank 0
            half = flat.numel() // 2
            flat[half:] = flat[:half]

    group = SimpleNamespace(allreduce_=allreduce_, error=None)
    position = SimpleNamespace(rank=0, world_size=2, generation=0)
    integ = Integrity(WorkerEnv(**env), tracked, group, position, None)  # type: ignore[arg-type]
    return integ, state, snaps


def test_a_numeric_flag_from_any_rank_rolls_back_and_skips_that_step() -> None:
    exchange = [0, 0, 0, 1]  # no digests; rank 1 saw a NaN
    integ, state, snaps = _integrity(exchange, on_nan="rollback", sdc_every=0)
    for step in range(1, 6):
        assert integ.begin(step)
        state["w"] += 1
        if step < 5:
            exchange[3] = 0
            assert integ.after_step(step) is None
            snaps.take(step)
    exchange[3] = 1
    back = integ.after_step(5)
    assert back is not None and back.step == 4 and float(state["w"][0]) == 4.0
    assert not integ.begin(5)  # skipped when the loop gets there
    assert integ.begin(6)
    snaps.take(5)
    assert integ.after_step(6) is not None  # a second skip ...
    assert integ.begin(7)
    with pytest.raises(NumericalFaultError, match="3 times within"):  # ... a third: verdict
        integ.after_step(7)


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.seen.append((kind, fields))


def test_a_passed_check_is_written_with_its_digest_and_a_mismatch_is_not() -> None:
    """``sdc_check`` for each check every replica passed (what the report counts and what
    proves a flip harmless); a mismatch writes ``sdc_detected`` instead."""
    exchange = [7, 7, 0, 0]  # both ranks' digests of the check step, no numeric flags
    integ, _state, snaps = _integrity(exchange, sdc_every=2)
    events = _Events()
    integ.log.events = events  # type: ignore[assignment]
    for step in (1, 2, 3):
        assert integ.begin(step)
        assert integ.after_step(step) is None
        snaps.take(step)
        integ.snapshotted(step)
    assert [(k, f["step"], f["digest"]) for k, f in events.seen] == [("sdc_check", 2, f"{7:016x}")]
    assert events.seen[0][1]["replicas"] == 2
    exchange[1] = 8  # rank 1's replica differs at check step 4
    assert integ.begin(4)
    integ.after_step(4)
    snaps.take(4)
    integ.snapshotted(4)
    back = integ.after_step(5)
    assert back is not None and back.step == 2  # the verified snapshot
    kinds = [k for k, _ in events.seen]
    assert kinds[1:] == ["sdc_detected", "fault_detected", "restore", "note"]
    assert "sdc_check" not in kinds[1:]
