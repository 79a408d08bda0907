"""The loader over a torch DataLoader: worker processes, prefetch, restore and resize."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import stalwart.data
from stalwart.data import Loader, epoch_permutation, loader
from stalwart.errors import ConfigError, StateMismatchError

pytestmark = pytest.mark.process  # DataLoader worker processes (tests/_tiers.py)


class _Indices(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class _Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def _take(ld: Loader, rounds: int) -> list[int]:
    return [int(x) for _ in range(rounds) for x in next(ld)]


def test_state_counts_consumed_batches_not_prefetched_ones() -> None:
    ld = loader(_Indices(40), batch_size=3, world_size=2, rank=1, num_workers=2)
    try:
        first = next(ld)
        # the DataLoader has drawn several index lists ahead; the state has only one round
        assert ld.state_dict()["position"] == 6 and ld.epoch == 0
        assert first.tolist() == epoch_permutation(40, 0, 0)[3:6].tolist()
    finally:
        ld.close()


def test_workers_rollback_and_resize_read_each_sample_once() -> None:
    """Two ranks with 2 workers each read 4 rounds; rank 1 reads 2 more rounds that are
    thrown away (failure); both roll back to round 4 and continue as 3 ranks (one joiner
    built from the state) until the epoch ends: every index once."""
    n, b = 64, 2  # 4 rounds of 2 x 2, then 8 rounds of 3 x 2: the epoch ends on a round
    ds = _Indices(n)
    ranks = [loader(ds, batch_size=b, world_size=2, rank=r, num_workers=2) for r in range(2)]
    try:
        seen = [x for _ in range(4) for ld in ranks for x in _take(ld, 1)]
        saved = json.loads(json.dumps(ranks[0].state_dict()))
        assert saved == ranks[1].state_dict()
        _take(ranks[1], 2)  # uncommitted work of a failed step
        for ld in ranks:
            ld.load_state_dict(saved)
        joiner = loader(ds, batch_size=b, world_size=3, rank=2, num_workers=2)
        joiner.load_state_dict(saved)
        ranks.append(joiner)
        for r, ld in enumerate(ranks[:2]):
            ld.reshard(world_size=3, rank=r)
        while ranks[0].epoch == 0:
            seen += [x for ld in ranks for x in _take(ld, 1)]
        assert sorted(seen) == list(range(n))
        assert {json.dumps(ld.state_dict()) for ld in ranks} == {json.dumps(ranks[0].state_dict())}
    finally:
        for ld in ranks:
            ld.close()


def test_persistent_workers_survive_a_restore() -> None:
    ld = loader(
        _Indices(30), batch_size=5, world_size=1, rank=0, num_workers=2, persistent_workers=True
    )
    try:
        sd = ld.state_dict()
        a = _take(ld, 3)
        ld.load_state_dict(sd)
        assert _take(ld, 3) == a
    finally:
        ld.close()


def test_snapshot_and_restore_through_the_checkpoint_engine(shm_namespace: str) -> None:
    from stalwart.checkpoint import SnapshotConfig, Snapshotter

    ld = loader(_Indices(25), batch_size=4, world_size=1, rank=0, tail="short")
    snaps = Snapshotter(SnapshotConfig(namespace=shm_namespace))
    try:
        _take(ld, 3)
        snaps.snapshot({"loader": ld}, step=3)
        after = _take(ld, 5)  # crosses into epoch 1 (25 samples, short tail)
        assert ld.epoch == 1
        assert snaps.restore({"loader": ld}) == 3
        assert (ld.epoch, ld.position) == (0, 12)
        assert _take(ld, 5) == after
    finally:
        snaps.close(unlink=True)


def test_rebuilding_the_iterator_leaves_the_global_rng_alone() -> None:
    """A restore rebuilds the DataLoader iterator; its worker base seed must not come from
    the global RNG, or a recovered run would draw differently from a fault-free one."""
    ld = loader(_Indices(30), batch_size=2, world_size=1, rank=0, num_workers=2)
    try:
        before = torch.get_rng_state()
        sd = ld.state_dict()
        a = _take(ld, 2)
        ld.load_state_dict(sd)
        assert _take(ld, 2) == a
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        ld.close()


def test_step_batches_and_epoch_wrap() -> None:
    ld = loader(_Indices(10), batch_size=4, world_size=1, rank=0, shuffle=False)
    ld.reshard(world_size=1, rank=0, micro_batches=3)
    got = [mb.tolist() for mb in ld.step_batches()]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]  # tail="carry"
    assert (ld.epoch, ld.position) == (1, 2)


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="sets 'drop_last' itself"):
        loader(_Indices(5), batch_size=1, drop_last=True)
    with pytest.raises(ConfigError, match="sets 'generator' itself"):
        loader(_Indices(5), batch_size=1, generator=torch.Generator())
    with pytest.raises(ConfigError, match="map-style dataset"):
        loader(_Stream(), batch_size=1)
    with pytest.raises(ConfigError, match="rank 3 of world size 2"):
        loader(_Indices(5), batch_size=1, world_size=2, rank=3)
    ld = loader(_Indices(5), batch_size=1, world_size=1, rank=0)
    other: dict[str, Any] = {**ld.state_dict(), "size": 6}
    with pytest.raises(StateMismatchError, match="size=6 but this loader has size=5"):
        ld.load_state_dict(other)
    with pytest.raises(StateMismatchError, match="not a version-1"):
        ld.load_state_dict({"epoch": 0})
    assert stalwart.data.loader is loader
