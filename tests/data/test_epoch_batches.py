"""stalwart.data.epoch_batches: the script's own DistributedSampler + DataLoader, in its
order, resumable at every position of an epoch, resharded on a world-size change."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from stalwart.data import EpochBatches, epoch_batches, rest_of_epoch
from stalwart.errors import ConfigError, StateMismatchError


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i: (its index, a feature row), so batches can be compared bit for bit."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.x = torch.rand(n, 3, generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(i), self.x[i]


def make(
    n: int,
    world: int,
    rank: int,
    *,
    batch: int = 3,
    shuffle: bool = True,
    sampler_drop: bool = False,
    loader_drop: bool = False,
    generator: torch.Generator | None = None,
    num_workers: int = 0,
) -> DataLoader[Any]:
    ds = Indexed(n)
    s = DistributedSampler(
        ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=sampler_drop
    )
    return DataLoader(
        ds,
        batch_size=batch,
        sampler=s,
        drop_last=loader_drop,
        generator=generator,
        num_workers=num_workers,
    )


def plain(dl: DataLoader[Any], epochs: range) -> list[Any]:
    """The unported loop: set_epoch, then every batch of the epoch."""
    out: list[Any] = []
    assert isinstance(dl.sampler, DistributedSampler)
    for epoch in epochs:
        dl.sampler.set_epoch(epoch)
        out.extend(dl)
    return out


def take(batches: EpochBatches, count: int) -> list[Any]:
    return [next(batches) for _ in range(count)]


def same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True)), (x[0], y[0])


SHAPES = [
    dict(n=23, world=3),
    dict(n=24, world=2, shuffle=False),
    dict(n=23, world=3, sampler_drop=True),
    dict(n=23, world=2, loader_drop=True),
    dict(n=5, world=4, batch=2),  # padding longer than what is left
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_a_fault_free_run_reads_the_plain_loops_batches(shape: dict[str, Any]) -> None:
    world = shape["world"]
    opts = {k: v for k, v in shape.items() if k not in ("n", "world")}
    for rank in range(world):
        ref = plain(make(shape["n"], world, rank, **opts), range(3))
        batches = epoch_batches(make(shape["n"], world, rank, **opts))
        same(take(batches, len(ref)), ref)
        assert batches.epoch == 3 and batches.position == 0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_a_resume_at_every_position_reads_the_batches_after_it(shape: dict[str, Any]) -> None:
    world = shape["world"]
    opts = {k: v for k, v in shape.items() if k not in ("n", "world")}
    for rank in range(world):
        ref = plain(make(shape["n"], world, rank, **opts), range(2))
        for k in range(len(ref)):
            first = epoch_batches(make(shape["n"], world, rank, **opts))
            done = take(first, k)
            resumed = epoch_batches(make(shape["n"], world, rank, **opts))
            resumed.load_state_dict(first.state_dict())
            same(done + take(resumed, len(ref) - k), ref)


def test_a_rollback_in_the_same_object_rereads_the_same_batches() -> None:
    dl = make(23, 3, 1)
    ref = plain(make(23, 3, 1), range(2))
    batches = epoch_batches(dl)
    take(batches, 2)
    saved = batches.state_dict()
    take(batches, 5)  # into the next epoch
    batches.load_state_dict(saved)
    same(take(batches, len(ref) - 2), ref[2:])


def test_the_epoch_end_is_said_and_plain_iteration_is_unchanged() -> None:
    dl = make(23, 3, 0)
    ref = plain(make(23, 3, 0), range(1))
    batches = epoch_batches(dl)
    ends = []
    for _ in range(len(ref) * 2):
        next(batches)
        ends.append(batches.ended_epoch)
    per = len(ref)
    assert ends == [None] * (per - 1) + [0] + [None] * (per - 1) + [1]
    assert isinstance(dl.sampler, DistributedSampler)
    dl.sampler.set_epoch(0)
    same(list(dl), ref)  # the script's own iteration of its DataLoader: its order


def test_opening_draws_like_the_plain_loop_and_a_reopening_replays_the_draw() -> None:
    torch.manual_seed(3)
    plain(make(23, 3, 0), range(2))
    after_plain = torch.get_rng_state()
    torch.manual_seed(3)
    batches = epoch_batches(make(23, 3, 0))
    per = len(make(23, 3, 0))
    take(batches, 2 * per)
    assert torch.equal(torch.get_rng_state(), after_plain)  # one draw per epoch, as plain

    torch.manual_seed(3)
    first = epoch_batches(make(23, 3, 0))
    take(first, 1)
    seed = first._it._it._base_seed  # type: ignore[union-attr]
    resumed = epoch_batches(make(23, 3, 0))
    resumed.load_state_dict(first.state_dict())
    rng = torch.get_rng_state()
    next(resumed)
    assert torch.equal(torch.get_rng_state(), rng)  # the session's restored RNG unmoved
    assert resumed._it._it._base_seed == seed  # type: ignore[union-attr]


def test_a_dataloaders_own_generator_rolls_back_with_the_state() -> None:
    ref_gen = torch.Generator().manual_seed(9)
    plain(make(23, 3, 2, generator=ref_gen), range(3))
    batches = epoch_batches(make(23, 3, 2, generator=torch.Generator().manual_seed(9)))
    per = len(make(23, 3, 2))
    take(batches, per + 1)
    saved = batches.state_dict()
    take(batches, per)  # past the next epoch's opening: the generator drew again
    batches.load_state_dict(saved)
    take(batches, 2 * per - 1)
    assert batches.epoch == 3
    assert torch.equal(batches.dataloader.generator.get_state(), ref_gen.get_state())  # type: ignore[union-attr]


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 3), (4, 1)])
def test_a_resize_deals_the_rest_of_the_epoch_once(old: int, new: int, drop: bool) -> None:
    n, b = 29, 2
    per = len(make(n, old, 0, batch=b, sampler_drop=drop))
    for k in range(per):
        seen: list[int] = []
        state: dict[str, Any] = {}
        for rank in range(old):
            before = epoch_batches(make(n, old, rank, batch=b, sampler_drop=drop))
            seen += [int(i) for batch in take(before, k) for i in batch[0]]
            state = before.state_dict()
        ended: list[int] = []
        for rank in range(new):
            after = epoch_batches(make(n, old, 0, batch=b, sampler_drop=drop))
            after.load_state_dict(state)
            after.reshard(world_size=new, rank=rank)
            while after.epoch == 0:
                ended += [int(i) for i in next(after)[0]]
            # the next epoch is the sampler's own order at the new size
            ref = plain(make(n, new, rank, batch=b, sampler_drop=drop), range(1, 2))
            same(take(after, len(ref)), ref)
        order = seen + ended
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
        if drop:  # each world's truncation drops at most world - 1 samples of the tail
            assert len(set(order)) == len(order) and len(order) >= n - old - new + 2
        else:  # every sample, and only padding from the epoch's start repeated
            assert set(order) == set(range(n))
            repeated = [i for i in set(order) if order.count(i) > 1]
            assert set(repeated) <= set(perm[: old + new]), (k, repeated)


def test_a_resize_that_leaves_this_rank_nothing_moves_to_the_next_epoch() -> None:
    before = epoch_batches(make(10, 3, 0, batch=1, sampler_drop=True))
    take(before, 2)  # 6 of 9 dealt; 4 of the permutation left, truncated to 3 at world 3
    after = epoch_batches(make(10, 3, 0, batch=1, sampler_drop=True))
    after.load_state_dict(before.state_dict())
    after.reshard(world_size=5, rank=4)  # 4 left, truncated to 0 at world 5
    ref = plain(make(10, 5, 4, batch=1, sampler_drop=True), range(1, 2))
    same(take(after, len(ref)), ref)


def test_rest_of_epoch_at_an_unchanged_size_is_the_samplers_own_list() -> None:
    ds = Indexed(23)
    for drop, world in itertools.product([False, True], [1, 2, 3, 5]):
        perm = torch.randperm(23, generator=torch.Generator().manual_seed(7)).tolist()
        for rank in range(world):
            s = DistributedSampler(ds, num_replicas=world, rank=rank, seed=7, drop_last=drop)
            own = list(s)
            for skip in range(len(own) + 1):
                assert rest_of_epoch(perm, skip * world, world, rank, drop) == own[skip:]


def test_misuse_and_foreign_state_are_refused() -> None:
    ds = Indexed(10)
    with pytest.raises(ConfigError, match="DistributedSampler"):
        epoch_batches(DataLoader(ds, batch_size=2, shuffle=True))
    dl = make(10, 2, 0)
    epoch_batches(dl)
    with pytest.raises(ConfigError, match="already wrapped"):
        epoch_batches(dl)
    batches = epoch_batches(make(10, 2, 0))
    with pytest.raises(StateMismatchError, match="size=11"):
        batches.load_state_dict({**batches.state_dict(), "size": 11})
    with pytest.raises(StateMismatchError, match="version"):
        batches.load_state_dict({"epoch": 0})
    with pytest.raises(ConfigError, match="no batch"):
        next(epoch_batches(make(3, 2, 0, batch=4, loader_drop=True)))


@pytest.mark.process  # DataLoader worker processes
def test_workers_resume_mid_epoch_in_the_plain_order() -> None:
    ref = plain(make(23, 2, 1, num_workers=2), range(2))
    first = epoch_batches(make(23, 2, 1, num_workers=2))
    done = take(first, 4)
    resumed = epoch_batches(make(23, 2, 1, num_workers=2))
    resumed.load_state_dict(first.state_dict())
    same(done + take(resumed, len(ref) - 4), ref)
