"""The generation group over its backend seam (runtime/backend.py), with a fake backend:
what a backend is asked to do at a formation, a failed collective, a generation change."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import HashStore

from stalwart.runtime.backend import GLOO, GlooBackend, GroupBackend
from stalwart.runtime.comm.group import GenerationGroup, GenerationMovedError


class _Work:
    def __init__(self, error: Exception | None = None, *, stuck: bool = False) -> None:
        self.error = error
        self.stuck = stuck

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.stuck:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return not self.stuck


class _FakeBackend:
    name = "fake"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.next_work = _Work()

    def create(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        comm = f"comm{len([c for c in self.calls if c[0] == 'create'])}"
        self.calls.append(("create", (comm, rank, world_size, timeout)))
        return comm

    def allreduce(self, comm: Any, tensors: list[torch.Tensor], timeout: timedelta) -> Any:
        self.calls.append(("allreduce", (comm, timeout)))
        return self.next_work

    def abandon(self, comm: Any, work: Any) -> None:
        self.calls.append(("abandon", comm))

    def drop(self, comm: Any) -> None:
        self.calls.append(("drop", comm))

    def at_exit(self) -> None:
        self.calls.append(("at_exit", None))


def _group(backend: _FakeBackend) -> GenerationGroup:
    group = GenerationGroup(None, 1, 2, 5.0, "seam", store=HashStore(), backend=backend)
    group.step_timeout = timedelta(seconds=42)
    return group


def test_the_gloo_backend_is_a_group_backend_and_the_default() -> None:
    backend: GroupBackend = GlooBackend()
    assert backend.name == "gloo" and backend.device == torch.device("cpu")
    assert GenerationGroup(None, 0, 1, 5.0, "default-test").backend is GLOO


def test_a_formation_creates_and_a_new_generation_drops_the_old_communicator() -> None:
    fake = _FakeBackend()
    group = _group(fake)
    group.build(0)
    group.build(1)
    assert fake.calls == [
        ("create", ("comm0", 1, 2, timedelta(seconds=5))),
        ("drop", "comm0"),
        ("create", ("comm1", 1, 2, timedelta(seconds=5))),
    ]
    group.close()
    assert fake.calls[-1] == ("drop", "comm1") and group.pg is None


def test_a_step_allreduce_gets_the_step_timeout_and_a_failure_drops_the_communicator() -> None:
    fake = _FakeBackend()
    group = _group(fake)
    group.build(0)
    group.allreduce_(torch.ones(3))
    assert group.error is None and ("allreduce", ("comm0", timedelta(seconds=42))) in fake.calls
    fake.next_work = _Work(RuntimeError("Connection closed by peer"))
    group.allreduce_(torch.ones(3))
    assert isinstance(group.error, RuntimeError) and group.pg is None
    assert fake.calls[-1] == ("drop", "comm0")


def test_a_generation_change_during_a_wait_abandons_the_communicator() -> None:
    fake = _FakeBackend()
    group = _group(fake)
    group.build(0)
    group.moved = lambda: True
    fake.next_work = _Work(stuck=True)
    group.allreduce_(torch.ones(3))
    assert isinstance(group.error, GenerationMovedError)
    assert ("abandon", "comm0") in fake.calls and group.pg is None


def test_at_exit_goes_to_the_backend() -> None:
    from stalwart.runtime.comm.group import leak_abandoned

    fake = _FakeBackend()
    leak_abandoned(fake)
    assert fake.calls == [("at_exit", None)]
