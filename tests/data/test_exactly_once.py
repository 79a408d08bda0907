"""Property: across any sequence of steps, failures (rollback to an earlier snapshot, with
uncommitted micro-batches thrown away), joins and resizes, the committed steps read every
sample index of an epoch exactly once; with ``tail="carry"`` and the constant global batch,
every optimizer step reads the same samples whatever the world size."""

from __future__ import annotations

import json
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data import BatchConfig, SamplerState, epoch_permutation, plan_batch

GLOBAL = 12
SIZES = [1, 2, 3, 4, 6, 12]


class _Tagged(SamplerState):
    """Encodes the epoch into each index (``epoch * n + index``) so that the test can
    attribute a sample to its epoch; the partition logic under test is unchanged."""

    def permutation(self, epoch: int) -> torch.Tensor:
        return super().permutation(epoch) + epoch * self.size


def _make(n: int, tail: Any, sd: dict[str, Any]) -> _Tagged:
    s = _Tagged(n, seed=7, tail=tail)
    s.load_state_dict(json.loads(json.dumps(sd)))  # a state travels as JSON
    return s


op = st.one_of(
    st.tuples(st.just("steps"), st.integers(1, 6)),
    st.tuples(st.just("fail"), st.integers(0, 5), st.integers(0, 3)),
    st.tuples(st.just("resize"), st.sampled_from(SIZES)),
)


@settings(max_examples=500, deadline=None, database=None)
@given(
    n=st.integers(1, 40),
    micro=st.integers(1, 7),
    world=st.sampled_from(SIZES),
    tail=st.sampled_from(["carry", "short"]),
    ops=st.lists(op, max_size=25),
)
def test_every_index_once_per_epoch(
    n: int, micro: int, world: int, tail: str, ops: list[tuple[Any, ...]]
) -> None:
    cfg = BatchConfig(global_batch=GLOBAL, micro_batch=micro)
    first = _Tagged(n, seed=7, tail=tail)  # type: ignore[arg-type]
    snapshots: list[tuple[int, dict[str, Any]]] = [(0, first.state_dict())]
    ledger: dict[int, list[int]] = {}
    step = 0
    ranks = [_make(n, tail, first.state_dict()) for _ in range(world)]

    def run_step() -> None:
        nonlocal step
        plan = plan_batch(cfg, len(ranks))
        before = ranks[0].state_dict()
        seen: list[int] = []
        for _ in range(plan.micro_batches):
            for r, s in enumerate(ranks):
                rd = s.next_round(len(ranks), r, plan.per_rank_batch)
                seen += rd.indices
                s.epoch, s.position = rd.epoch, rd.position
        states = {json.dumps(s.state_dict()) for s in ranks}
        assert len(states) == 1, "ranks disagree on the loader state"
        if tail == "carry":  # the step reads the next GLOBAL samples of the stream
            start = before["epoch"] * n + before["position"]
            stream = [
                e * n + int(i)
                for e in range(start // n, (start + GLOBAL) // n + 1)
                for i in epoch_permutation(n, 7, e)
            ]
            assert sorted(seen) == sorted(stream[start % n : start % n + GLOBAL])
        step += 1
        ledger[step] = seen
        snapshots.append((step, ranks[0].state_dict()))

    for o in ops:
        if o[0] == "steps":
            for _ in range(o[1]):
                run_step()
        elif o[0] == "fail":
            # a failure mid-step: some micro-batches read and thrown away, then roll back
            for _ in range(o[1]):
                for r, s in enumerate(ranks):
                    rd = s.next_round(len(ranks), r, 1)
                    s.epoch, s.position = rd.epoch, rd.position
            target = max(0, len(snapshots) - 1 - o[2])
            step, sd = snapshots[target]
            del snapshots[target + 1 :]
            for k in [k for k in ledger if k > step]:
                del ledger[k]
            ranks = [_make(n, tail, sd) for _ in ranks]
        else:  # resize: survivors keep their objects, joiners get a survivor's state
            sd = ranks[0].state_dict()
            ranks = ranks[: o[1]] + [_make(n, tail, sd) for _ in range(o[1] - len(ranks))]

    final = ranks[0]
    by_epoch: dict[int, list[int]] = {}
    for k in sorted(ledger):
        for v in ledger[k]:
            by_epoch.setdefault(v // n, []).append(v % n)
    for e in range(final.epoch):
        assert sorted(by_epoch.get(e, [])) == list(range(n)), f"epoch {e}"
    current = by_epoch.get(final.epoch, [])
    assert len(current) == len(set(current))
    assert set(current) == set(epoch_permutation(n, 7, final.epoch)[: final.position].tolist())
    assert not [e for e in by_epoch if e > final.epoch]
