"""``stalwart.data.loader``: a resumable, reshardable loader over a map-style dataset.

It wraps a torch :class:`~torch.utils.data.DataLoader` (worker processes, pinning and
collation are torch's) and replaces its sampler with :class:`SamplerState`. It is an
endless iterator of micro-batches (epochs follow one another); ``state_dict`` /
``load_state_dict`` make it a tracked object of the checkpoint engine (a small JSON dict,
nothing pickled), and ``reshard`` re-partitions what is left of the epoch for a new
world size.

Why the sampler lives in the main process: a DataLoader with workers draws index
lists from its sampler in the main process and ships only the lists to the workers, and it
prefetches (``prefetch_factor x num_workers`` batches ahead). So the sampler's own
position runs ahead of training. The loader therefore records, per index list handed to
the DataLoader, the state *after* it, and commits that state only when the matching
batch is returned to the training loop. A snapshot thus holds exactly what training
consumed; prefetched batches are dropped on restore or resize (the iterator is rebuilt
from the committed position). A sampler copied into workers could not do this: its
position would live in other processes that a rollback or resize cannot reach.

Why the loader has its own ``torch.Generator``: a DataLoader draws its workers' base seed
from ``generator`` (the *global* torch RNG when None) every time an iterator is built.
The loader rebuilds its iterator after a restore or resize, so with the global RNG a
recovered run would draw once more than a fault-free one and every later dropout mask
would differ (the bit-identical invariant, DESIGN.md §4). Instead the base seed comes
from a private generator seeded with ``(seed, epoch, position)`` at each build: the
training process's RNG is untouched, and worker-side randomness is a function of the
position the iterator was built at (for augmentations that must be identical across
failures, derive them from the sample index; docs/data.md).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from stalwart.compat.torch_data import forget_iterator, worker_shutdown
from stalwart.data.sampler import SamplerState, Tail
from stalwart.errors import ConfigError

__all__ = ["Loader", "loader"]


class _RoundSource:
    """The ``batch_sampler`` handed to the DataLoader: each ``iter()`` starts from the
    loader's committed state and queues the state after every round it yields."""

    def __init__(self, owner: Loader) -> None:
        self._owner = owner

    def __iter__(self) -> Iterator[list[int]]:
        # read the committed state now (iter() time), not at the generator's first next()
        o = self._owner
        state, ahead = o._sampler, o._ahead
        return self._rounds(
            state, ahead, state.epoch, state.position, o.world_size, o.rank, o.batch_size
        )

    @staticmethod
    def _rounds(
        state: SamplerState,
        ahead: deque[tuple[int, int]],
        epoch: int,
        position: int,
        world_size: int,
        rank: int,
        batch_size: int,
    ) -> Iterator[list[int]]:
        while True:
            r = state.round_at(epoch, position, world_size, rank, batch_size)
            epoch, position = r.epoch, r.position
            ahead.append((epoch, position))
            yield r.indices


class Loader:
    """Endless iterator of this rank's micro-batches; see :func:`loader`."""

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        world_size: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        tail: Tail = "carry",
        micro_batches: int = 1,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        **dataloader_kwargs: Any,
    ) -> None:
        for bad in ("sampler", "batch_sampler", "shuffle", "drop_last", "batch_size", "generator"):
            if bad in dataloader_kwargs:
                raise ConfigError(
                    f"stalwart.data.loader sets {bad!r} itself (it owns the sample order); "
                    "remove it from the arguments"
                )
        try:
            size = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError(
                "stalwart.data.loader needs a map-style dataset with __len__; for an "
                "iterable dataset see docs/data.md"
            ) from None
        self._sampler = SamplerState(size, seed=seed, shuffle=shuffle, tail=tail)
        self.world_size = 1
        self.rank = 0
        self.batch_size = 1
        self.micro_batches = 1
        self.reshard(
            world_size=int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size,
            rank=int(os.environ.get("RANK", "0")) if rank is None else rank,
            batch_size=batch_size,
            micro_batches=micro_batches,
        )
        self._ahead: deque[tuple[int, int]] = deque()
        self._it: Iterator[Any] | None = None
        self._generator = torch.Generator()
        self._dl = DataLoader(
            dataset,
            batch_sampler=_RoundSource(self),
            generator=self._generator,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            **dataloader_kwargs,
        )

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Any:
        s = self._sampler
        it = self._it
        if it is None:
            self._ahead = deque()
            self._generator.manual_seed(_worker_seed(s.seed, s.epoch, s.position))
            it = self._it = iter(self._dl)
        batch = next(it)
        s.epoch, s.position = self._ahead.popleft()
        return batch

    def step_batches(self) -> Iterator[Any]:
        """The ``micro_batches`` micro-batches of one optimizer step (gradient
        accumulation; the count is set by :meth:`reshard` from the batch policy)."""
        for _ in range(self.micro_batches):
            yield next(self)

    @property
    def epoch(self) -> int:
        return self._sampler.epoch

    @property
    def position(self) -> int:
        """Samples of the current epoch consumed by the whole job."""
        return self._sampler.position

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What training consumed so far (not what was prefetched); rank-independent."""
        return self._sampler.state_dict()

    def load_state_dict(self, sd: Any) -> None:
        """Continue from ``sd`` (a rollback or a restore); prefetched batches are dropped."""
        self._sampler.load_state_dict(sd)
        self._drop_iterator()

    def reshard(
        self,
        *,
        world_size: int,
        rank: int,
        batch_size: int | None = None,
        micro_batches: int | None = None,
    ) -> None:
        """Read the rest of the epoch as ``rank`` of ``world_size`` (and with another
        per-rank batch size / accumulation count, from the batch policy)."""
        batch_size = self.batch_size if batch_size is None else batch_size
        micro_batches = self.micro_batches if micro_batches is None else micro_batches
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} of world size {world_size}: need 0 <= rank < world")
        if batch_size < 1 or micro_batches < 1:
            raise ConfigError(
                f"batch_size={batch_size}, micro_batches={micro_batches}: both must be >= 1"
            )
        changed = (world_size, rank, batch_size) != (self.world_size, self.rank, self.batch_size)
        self.world_size, self.rank, self.batch_size = world_size, rank, batch_size
        self.micro_batches = micro_batches
        if changed:
            self._drop_iterator()

    def _drop_iterator(self) -> None:
        # iter() builds a new one from the committed state; with persistent_workers the
        # DataLoader keeps its worker processes and only drains what they had in flight
        self._it = None

    def close(self) -> None:
        """Stop the worker processes now (they also stop when the loader is collected)."""
        it, self._it = self._it, None
        shutdown = worker_shutdown(it)
        if shutdown is not None:
            shutdown()
        forget_iterator(self._dl)


def _worker_seed(seed: int, epoch: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + position) % (1 << 63)


def loader(dataset: Dataset[Any], batch_size: int, **options: Any) -> Loader:
    """A resumable, reshardable loader of ``batch_size`` samples per rank and micro-batch.

    ``world_size``/``rank`` default to the ``WORLD_SIZE``/``RANK`` environment (as set by
    ``stalwart run`` and torchrun); ``seed``, ``shuffle`` and ``tail`` ("carry" or
    "short", see :mod:`stalwart.data.sampler`) fix the sample order; the rest
    (``num_workers``, ``collate_fn``, ``pin_memory``, ``persistent_workers``, ...) go to
    the torch DataLoader. Track it (``sess.track(loader=loader)``) to checkpoint it.
    """
    return Loader(dataset, batch_size=batch_size, **options)
