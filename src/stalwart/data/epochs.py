"""``stalwart.data.epoch_batches``: the script's own ``DistributedSampler`` + ``DataLoader``,
resumable mid-epoch, in the order the script already reads.

The most common training loop is an epoch loop over a DataLoader whose sampler is a
``DistributedSampler`` (``set_epoch`` each epoch). Ported to ``sess.steps()`` it becomes
one flat loop of steps, and the batch of a step must be the one the unported loop read at
that point: :class:`EpochBatches` is an endless iterator over the DataLoader, epoch after
epoch (it calls ``set_epoch``), whose state (epoch, samples of the epoch consumed by the
job) is tracked with the rest of the training state. A restore, a rollback or a
replacement continues with the batch after the restored step (none repeated, none
skipped), and a fault-free run reads exactly the batches of the unported script: the
DataLoader is the script's own (its workers, collation, pinning), and so is the sampler's
order.

Why the position is global (samples of the epoch consumed by the whole job): a
``DistributedSampler`` deals the epoch's permutation to the ranks round-robin (rank ``r``
reads entries ``r, r + W, r + 2W, ...`` of the permutation padded to a multiple of
``W``), so after ``k`` batches of ``b`` on every rank the job has consumed exactly the
first ``k * b * W`` entries. The position is the same number on every rank and does not
depend on the world size, so the same state serves a resize (:meth:`EpochBatches.reshard`):
the rest of the epoch, ``perm[P:]``, is dealt to the new world as the sampler deals a
whole epoch (padded with the epoch's first samples to a multiple of the new size, or
truncated to one with ``drop_last=True``; rank ``r`` reads every ``W``-th entry from
``r``); the following epochs are the sampler's own order at the new size. At an
unchanged world size that rule *is* the sampler's order from ``P`` on, so resuming reads
the sampler's own list and skips what was consumed; only the first epoch after a resize
is computed here, from the sampler's permutation (read through the sampler itself with
one replica).

Why the iterator's random draw is replayed: opening a DataLoader iterator draws the
workers' base seed from the DataLoader's ``generator`` (the global torch RNG when None).
The unported loop draws once per epoch, when the epoch's ``for`` opens it; this wrapper
does the same at the same point (the first batch of an epoch). Re-opening mid-epoch after
a restore draws with the generator set to its state before the epoch's original opening
(kept in the state) and then put back, so the workers get the seeds they had and the
global RNG the session restored is not moved. A DataLoader's own ``generator`` is not
among the process RNGs a session tracks, so its state is kept here too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from stalwart.compat.torch_data import worker_shutdown
from stalwart.errors import ConfigError, StateMismatchError

__all__ = ["EPOCH_STATE_VERSION", "EpochBatches", "epoch_batches", "rest_of_epoch"]

EPOCH_STATE_VERSION = 1


def rest_of_epoch(
    perm: list[int], position: int, world_size: int, rank: int, drop_last: bool
) -> list[int]:
    """What ``rank`` of ``world_size`` reads of an epoch whose permutation is ``perm`` after
    the job consumed its first ``position`` entries: the rest dealt as ``DistributedSampler``
    deals a whole epoch (at ``position=0`` this is the sampler's own list)."""
    n = len(perm)
    rest = perm[min(position, n) :]
    if drop_last:
        rest = rest[: len(rest) - len(rest) % world_size]
    else:
        pad = -len(rest) % world_size
        if pad:
            rest = rest + (perm * math.ceil(pad / n))[:pad]
    return rest[rank::world_size]


class _Dealer:
    """Installed as the sampler of the DataLoader's ``BatchSampler``: plain iteration
    yields the script's sampler's own order; the one iteration the wrapper opens with a
    ``plan`` yields that plan instead (a resumed or resharded epoch)."""

    def __init__(self, sampler: DistributedSampler[Any]) -> None:
        self.sampler = sampler
        self.plan: list[int] | None = None

    def __iter__(self) -> Iterator[int]:
        plan, self.plan = self.plan, None
        return iter(self.sampler) if plan is None else iter(plan)

    def __len__(self) -> int:
        return len(self.sampler)


class EpochBatches:
    """Endless iterator of this rank's batches of a DataLoader over a ``DistributedSampler``;
    see :func:`epoch_batches` and the module doc."""

    def __init__(self, dataloader: DataLoader[Any], *, start_epoch: int = 0) -> None:
        batches = dataloader.batch_sampler
        sampler = getattr(batches, "sampler", None)
        if isinstance(sampler, _Dealer):
            raise ConfigError(
                "this DataLoader is already wrapped by stalwart.data.epoch_batches; "
                "wrap it once and track that one"
            )
        if not isinstance(batches, BatchSampler) or not isinstance(sampler, DistributedSampler):
            raise ConfigError(
                "stalwart.data.epoch_batches needs a DataLoader built with "
                "sampler=DistributedSampler(...) and a batch_size (not a batch_sampler); "
                "for another sampler use stalwart.data.loader (docs/porting.md)"
            )
        if start_epoch < 0:
            raise ConfigError(f"start_epoch={start_epoch}: need >= 0")
        self.dataloader = dataloader
        self.sampler: DistributedSampler[Any] = sampler
        self._batches = batches
        self._dealer = _Dealer(sampler)
        batches.sampler = self._dealer
        self.size = len(sampler.dataset)  # type: ignore[arg-type]
        self.epoch = start_epoch  # the epoch the next batch comes from
        self.position = 0  # entries of that epoch's permutation the job consumed
        self.micro_batches = 1
        self._it: Iterator[Any] | None = None
        self._left = 0  # batches of the open iterator still to come
        self._seg = (0, 0)  # (position the iterator opened at, its per-rank list length)
        self._taken = 0  # batches taken from the open iterator
        own = dataloader.generator
        self._generator: torch.Generator = own if own is not None else torch.default_generator
        self._own_generator = own is not None
        self._open_rng: torch.Tensor = self._generator.get_state()
        self.ended_epoch: int | None = None  # the epoch the batch last returned ended

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> EpochBatches:
        return self

    def __next__(self) -> Any:
        empty = 0
        while True:
            if self._it is None:
                self._open()
            if self._left > 0:
                break
            self._next_epoch()
            empty += 1
            if empty > 1:
                raise ConfigError(
                    f"an epoch of {self.size} samples gives rank {self.sampler.rank} of "
                    f"{self.sampler.num_replicas} no batch of {self._batches.batch_size} "
                    "(drop_last): use a smaller batch_size or more data"
                )
        assert self._it is not None
        batch = next(self._it)
        self._taken += 1
        self._left -= 1
        start, length = self._seg
        self.position = start + min(self._taken * self._batch_size, length) * self._world
        self.ended_epoch = self.epoch if self._left == 0 else None
        if self._left == 0:
            self._next_epoch()
        return batch

    def step_batches(self) -> Iterator[Any]:
        """The ``micro_batches`` batches of one optimizer step (set by :meth:`reshard`
        from a batch policy; 1 otherwise)."""
        for _ in range(self.micro_batches):
            yield next(self)

    @property
    def _batch_size(self) -> int:
        return int(self._batches.batch_size)

    @property
    def _world(self) -> int:
        return int(self.sampler.num_replicas)

    def _next_epoch(self) -> None:
        self.epoch, self.position = self.epoch + 1, 0
        self._it = None

    def _open(self) -> None:
        """Open the DataLoader at ``(epoch, position)``: at an epoch's start as the
        unported loop does (its draw included), else a re-opening that replays the
        epoch's draw (module doc)."""
        s = self.sampler
        s.set_epoch(self.epoch)
        world, rank, p = s.num_replicas, s.rank, self.position
        if p == 0:
            self._open_rng = self._generator.get_state()
            plan = None
            length = len(s)
            it = iter(self.dataloader)
        else:
            if p % world == 0:  # the sampler's own list, what was consumed skipped
                plan = list(s)[p // world :]
            else:  # the first epoch after a resize (module doc)
                plan = rest_of_epoch(self._permutation(), p, world, rank, bool(s.drop_last))
            length = len(plan)
        b = self._batch_size
        self._left = length // b if self._batches.drop_last else -(-length // b)
        self._seg, self._taken = (p, length), 0
        if plan is not None:
            if not self._left:  # nothing of the epoch left here: nothing to open
                self._it = iter(())
                return
            with self._replayed_draw():
                self._dealer.plan = plan
                it = iter(self.dataloader)
        self._it = _Pulled(it, self._dealer)

    @contextlib.contextmanager
    def _replayed_draw(self) -> Iterator[None]:
        g = self._generator
        now = g.get_state()
        g.set_state(self._open_rng)
        try:
            yield
        finally:
            g.set_state(now)

    def _permutation(self) -> list[int]:
        """The epoch's permutation, read through the sampler as one replica (so a subclass
        that changes how the permutation is drawn is followed)."""
        s = self.sampler
        saved = (s.num_replicas, s.rank, s.num_samples, s.total_size)
        s.num_replicas, s.rank, s.num_samples, s.total_size = 1, 0, self.size, self.size
        try:
            return list(s)
        finally:
            s.num_replicas, s.rank, s.num_samples, s.total_size = saved

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Where training is in the epochs (what the loop consumed, not what the
        DataLoader's workers prefetched), and the DataLoader's draws."""
        s = self.sampler
        sd: dict[str, Any] = {
            "version": EPOCH_STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "size": self.size,
            "seed": int(s.seed),
            "shuffle": bool(s.shuffle),
            "drop_last": bool(s.drop_last),
            "open_rng": self._open_rng.clone(),
        }
        if self._own_generator:
            sd["loader_rng"] = self._generator.get_state()
        return sd

    def load_state_dict(self, sd: Any) -> None:
        """Continue after the batch ``sd`` was taken at; what was prefetched is dropped."""
        if not isinstance(sd, dict) or sd.get("version") != EPOCH_STATE_VERSION:
            raise StateMismatchError(
                f"data state {sd!r:.120} is not a version-{EPOCH_STATE_VERSION} "
                "stalwart.data.epoch_batches state; restore a checkpoint written by this version"
            )
        s = self.sampler
        for key, mine in (
            ("size", self.size),
            ("seed", int(s.seed)),
            ("shuffle", bool(s.shuffle)),
            ("drop_last", bool(s.drop_last)),
        ):
            if sd.get(key) != mine:
                raise StateMismatchError(
                    f"data state has {key}={sd.get(key)!r} but this DataLoader's sampler has "
                    f"{key}={mine!r}; build the dataset and DistributedSampler as the saved run did"
                )
        epoch, position = sd.get("epoch"), sd.get("position")
        if not isinstance(epoch, int) or not isinstance(position, int):
            raise StateMismatchError(f"data state has no integer epoch/position: {sd!r:.200}")
        if epoch < 0 or not 0 <= position <= self.size:
            raise StateMismatchError(
                f"data state epoch={epoch}, position={position} is out of range for "
                f"{self.size} samples; the checkpoint is damaged"
            )
        self.epoch, self.position = epoch, position
        self._open_rng = _rng_tensor(sd.get("open_rng"), "open_rng")
        if self._own_generator and "loader_rng" in sd:
            self._generator.set_state(_rng_tensor(sd["loader_rng"], "loader_rng"))
        self._drop()

    def reshard(
        self,
        *,
        world_size: int,
        rank: int,
        batch_size: int | None = None,
        micro_batches: int | None = None,
    ) -> None:
        """Read the rest of the epoch as ``rank`` of ``world_size`` (module doc: the order);
        the sampler is set to the new size for the epochs after it. ``batch_size`` and
        ``micro_batches`` come from a batch policy (``sess.use_batch``)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} of world size {world_size}: need 0 <= rank < world")
        if (batch_size is not None and batch_size < 1) or (
            micro_batches is not None and micro_batches < 1
        ):
            raise ConfigError(f"batch_size={batch_size}, micro_batches={micro_batches}: need >= 1")
        s = self.sampler
        if (world_size, rank) != (s.num_replicas, s.rank):
            n = self.size
            s.num_replicas, s.rank = world_size, rank
            if s.drop_last and n % world_size:
                s.num_samples = math.ceil((n - world_size) / world_size)
            else:
                s.num_samples = math.ceil(n / world_size)
            s.total_size = s.num_samples * world_size
            self._drop()
        if batch_size is not None and batch_size != self._batch_size:
            self._batches.batch_size = batch_size
            self._drop()
        if micro_batches is not None:
            self.micro_batches = micro_batches

    def _drop(self) -> None:
        it, self._it = self._it, None
        shutdown = worker_shutdown(it)
        if callable(shutdown) and not self.dataloader.persistent_workers:
            shutdown()


class _Pulled(Iterator[Any]):
    """The DataLoader's iterator with its first index list drawn now: a single-process
    DataLoader draws from its batch sampler lazily, and the plan given to the dealer must
    be taken by this iterator, not a later one the script opens."""

    def __init__(self, it: Iterator[Any], dealer: _Dealer) -> None:
        self._it = it
        self._first: list[Any] = [next(it)] if dealer.plan is not None else []
        dealer.plan = None
        self._shutdown_workers = worker_shutdown(it)  # torch's name: worker_shutdown() finds it

    def __next__(self) -> Any:
        if self._first:
            return self._first.pop()
        return next(self._it)


def _rng_tensor(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        raise StateMismatchError(
            f"data state's {name} is not a generator state (uint8 tensor); the checkpoint "
            "is damaged"
        )
    return value


def epoch_batches(dataloader: DataLoader[Any], *, start_epoch: int = 0) -> EpochBatches:
    """The batches of ``dataloader`` (built with ``sampler=DistributedSampler(...)``),
    epoch after epoch, resumable and reshardable: ``next(batches)`` each step, track it
    (``sess.track(data=batches)``). ``batches.epoch`` is the epoch of the next batch,
    ``batches.ended_epoch`` is the epoch the batch just returned ended (None mid-epoch). The
    DataLoader is changed in one way: its batch sampler reads the sampler through a
    dealer that can start mid-epoch; iterating it directly still yields the sampler's
    order. See docs/porting.md."""
    return EpochBatches(dataloader, start_epoch=start_epoch)
