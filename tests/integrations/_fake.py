"""A stand-in for ``Session`` that runs the step transaction of ``sess.steps()`` in one
process, with a rollback on demand: what the integrations' drivers see of a real one.

``fail_at[k] = j``: the first time step ``k`` ends, the step counts as failed and the
tracked state is put back as it was after step ``j`` (its snapshot, taken at the step
boundary like the real session's), and the generator goes on from ``j + 1``. After
``align_steps(k)`` only multiples of ``k`` are snapshotted (a ``j`` between them is no
snapshot: the test asking for it fails).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from stalwart.checkpoint import RNGState


def same_params(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit-identical parameter lists (the integrations' bar against the plain framework)."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class FakeSession:
    def __init__(self, fail_at: dict[int, int] | None = None, start_at: int = 0) -> None:
        self.fail_at = dict(fail_at or {})
        self.start_at = start_at  # a restored job: the steps before it were done earlier
        self.state: dict[str, Any] = {}
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.pauses: list[str] = []  # every pause opened, in order
        self.open_pauses = 0
        self.logged: list[dict[str, Any]] = []
        self.yielded: list[int] = []
        self.generation = 0
        self.rank, self.world_size = 0, 1
        self.unit = 1

    def align_steps(self, unit: int) -> None:
        self.unit = unit

    def track(self, **state: Any) -> dict[str, Any]:
        self.state = dict(state, rng=RNGState())
        return self.state

    def _snapshot(self, step: int) -> None:
        if step % self.unit:
            return
        self.snapshots[step] = {k: copy.deepcopy(v.state_dict()) for k, v in self.state.items()}

    def _restore(self, step: int) -> None:
        for k, v in self.state.items():
            v.load_state_dict(copy.deepcopy(self.snapshots[step][k]))

    def steps(self, total: int) -> Iterator[int]:
        done = 0
        if self.start_at:  # as a replacement worker restores the newest snapshot
            self._snapshot(self.start_at)
            self._restore(self.start_at)
            done = self.start_at
        else:
            self._snapshot(0)
        while done < total:
            step = done + 1
            self.yielded.append(step)
            yield step
            back = self.fail_at.pop(step, None)
            if back is not None:
                self.generation += 1
                self._restore(back)
                done = back
                continue
            done = step
            self._snapshot(step)

    @contextlib.contextmanager
    def pause(self, what: str) -> Iterator[None]:
        self.pauses.append(what)
        self.open_pauses += 1
        try:
            yield
        finally:
            self.open_pauses -= 1

    def log(self, **metrics: Any) -> None:
        self.logged.append(metrics)
