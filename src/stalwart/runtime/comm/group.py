"""A process group per generation under a DDP model that is built once.

DDP keeps the process group it was built with, and an exception inside a DDP comm hook
breaks its reducer for good (every later step then fails an
``unmarked_param_indices`` internal assert). So the user's DDP is built over a local
world-size-1 default group, and :class:`GenerationGroup` installs a comm hook that does
the real allreduce over the current generation's communicator (built by a
:class:`~stalwart.runtime.backend.GroupBackend`, gloo's ``ProcessGroupGloo`` today, over a
``PrefixStore`` per generation on a TCPStore that outlives every worker, or on the
coordinator's own store under ``--rdzv etcd://``: runtime/comm/_c10d_store.py). The hook never
raises: an error is recorded, the buckets are returned as they are, and the session
discards the step.

The hook defers every bucket until the last one and allreduces all gradients as one
flat tensor in a canonical order (the parameters' order in the model). Why: a worker
that just joined has DDP's initial bucket layout while survivors have the rebuilt one;
a per-bucket allreduce would then sum unrelated bytes. One ordered allreduce per step
is layout-independent, and on CPU (where comm/compute overlap buys little) it is also
the cheapest.

Elastic runs change the group's size between generations (:meth:`resize`): ranks are
renumbered densely, the next :meth:`build` forms a group of the new size and the hook
divides by it. With ``signal_slot`` the flat tensor carries one more element, each rank's
:attr:`signal` (a vote to stop at this step boundary, e.g. a joiner is ready): after the
step every member reads the same :attr:`signalled`, so all stop at the same step without
another round trip.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stalwart.compat.torch_c10d import GradBucket, HashStore, PrefixStore, TCPStore
from stalwart.runtime.backend import GLOO, GroupBackend

__all__ = [
    "GenerationGroup",
    "GenerationMovedError",
    "ensure_local_default_group",
    "leak_abandoned",
]


_SLICE = timedelta(milliseconds=10)  # how often a waiting collective looks at the generation


class GenerationMovedError(RuntimeError):
    """The job's generation moved on while this collective waited: its group is being
    re-formed (a member was lost), so waiting longer cannot help."""


def leak_abandoned(backend: GroupBackend = GLOO) -> None:
    """At exit: never destroy a group whose work may still wait (it would block the
    process's exit for up to the collective timeout). The OS reclaims it."""
    backend.at_exit()


def ensure_local_default_group() -> None:
    """A world-size-1 default group, so that user code can build DDP before any peer
    is known and keep it across generations."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)


class GenerationGroup:
    def __init__(
        self,
        c10d: tuple[str, int] | None,
        rank: int,
        world_size: int,
        timeout_s: float,
        namespace: str,
        *,
        is_master: bool = False,
        store: Any = None,
        backend: GroupBackend = GLOO,
    ) -> None:
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        # a step's allreduce may wait longer than formation: a peer in ``sess.pause``
        # (an eval on rank 0) is late on purpose; formation keeps ``timeout``
        self.step_timeout = self.timeout
        self.namespace = namespace
        self.pg: Any = None
        self.generation = -1
        self.error: BaseException | None = None
        self.on_collective: Callable[[bool], None] | None = None
        # set by the session (every backend and strategy): True once the job moved
        # past this group's generation, so a collective stuck on a lost peer is left
        # at once instead of at the peer's socket close (its process teardown) or, for
        # a silent machine, the timeout
        self.moved: Callable[[], bool] | None = None
        self._store: Any = None
        self._c10d = c10d
        self._is_master = is_master
        self._given_store = store  # e.g. CoordStoreC10d over etcd: no host to lose
        self.signal_slot = False  # elastic: carry a stop vote in the allreduce
        self.signal = 0.0  # this rank's vote for the current step
        self.signalled = False  # any member voted (valid after a successful step)
        if world_size > 1:
            self._connect()
        self._params: dict[int, int] = {}
        self._pending: list[tuple[Any, torch.futures.Future[torch.Tensor]]] = []
        self.last_allreduce_s = 0.0
        # sub-groups of a 2-D mesh (runtime/comm/_mesh.py): name -> the job ranks in ours
        self._subgroups: dict[str, tuple[int, ...]] = {}
        self._subpgs: dict[str, Any] = {}

    def _connect(self) -> None:
        if self._given_store is not None:
            self._store = self._given_store
            return
        assert self._c10d is not None, "a multi-worker job needs a c10d store address"
        self._store = TCPStore(
            self._c10d[0],
            self._c10d[1],
            None,
            self._is_master,
            timedelta(seconds=60),
            wait_for_workers=False,
        )

    def resize(self, rank: int, world_size: int) -> None:
        """Take ``rank`` of ``world_size`` in the next :meth:`build` (elastic)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        self.rank, self.world_size = rank, world_size
        if world_size > 1 and self._store is None:
            self._connect()

    @property
    def store(self) -> Any:
        """The job's c10d store the generations form over (None before a multi-worker
        formation); a group registered beside this one (the job's default) uses it."""
        return self._store

    def add_subgroup(self, name: str, ranks: tuple[int, ...]) -> None:
        """Form, at every :meth:`build` from now on, a sub-group of the job ranks
        ``ranks`` (this rank among them) beside the world's: a mesh dimension's group
        (runtime/comm/_mesh.py). Every member of ``ranks`` adds it under the same ``name``."""
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in sub-group {name!r} {ranks}")
        self._subgroups[name] = tuple(ranks)

    def sub(self, name: str) -> Any:
        """The current generation's communicator of sub-group ``name`` (None when the
        generation is not formed, or was dropped after a failure)."""
        return self._subpgs.get(name)

    def build(self, generation: int) -> None:
        """Form the group of ``generation`` and its sub-groups; raises if a member is
        missing or fails."""
        self.drop()
        self.error = None
        self.signalled = False
        if self.world_size > 1:
            store = PrefixStore(f"{self.namespace}/gen{generation}", self._store)
            self.pg = self.backend.create(store, self.rank, self.world_size, self.timeout)
            for name, ranks in self._subgroups.items():  # same order on every member
                sub = PrefixStore(f"{self.namespace}/gen{generation}/{name}", self._store)
                self._subpgs[name] = self.backend.create(
                    sub, ranks.index(self.rank), len(ranks), self.timeout
                )
        self.generation = generation

    def drop(self) -> None:
        """Stop using the current communicator (a collective on it failed, or the next
        generation is formed): the peers that are not our ring neighbours then fail
        within milliseconds too instead of at the timeout."""
        pg, self.pg = self.pg, None
        subs, self._subpgs = self._subpgs, {}
        for comm in [pg, *subs.values()]:
            if comm is not None:
                self.backend.drop(comm)

    def allreduce_(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` over the group in place; errors are recorded, never raised."""
        if self.error is not None or self.pg is None:
            return
        if self.on_collective is not None:
            self.on_collective(True)
        t0 = time.perf_counter()
        try:
            try:
                work = self.backend.allreduce(self.pg, [flat], self.step_timeout)
                err = self.error_of(work)
                del work
            except Exception as failed:  # the call itself failed (no work to wait for)
                err = failed.with_traceback(None)
            if err is not None:
                self.error = err
                self.drop()
        finally:
            self.last_allreduce_s = time.perf_counter() - t0
            if self.on_collective is not None:
                self.on_collective(False)

    def wait(self, work: Any) -> None:
        """Wait for ``work`` of the current group; raises its error, or
        :class:`GenerationMovedError` (after burying the group) when the generation
        moved on meanwhile."""
        err = self.error_of(work)
        del work  # not kept alive by the traceback of what we raise
        if err is not None:
            raise err

    def error_of(self, work: Any) -> BaseException | None:
        """The error of ``work`` (None: it succeeded), without its traceback: a traceback
        keeps this frame, hence ``work``, hence the group's sockets alive, and the peers
        that are not our ring neighbours would wait for the timeout instead of seeing
        them close. Without :attr:`moved`, a plain wait (no polling at all)."""
        try:
            if self.moved is None:
                work.wait()
                return None
            while True:
                try:
                    work.wait(timeout=_SLICE)
                    return None
                except RuntimeError:
                    if work.is_completed():
                        # it ended between the slice's timeout and now, or failed: its
                        # own outcome (a plain wait returns at once, or raises its error)
                        work.wait()
                        return None
                    if not self.moved():
                        continue  # a slice passed: look again
                # the work may be a sub-group's: keep every communicator it may use
                for comm in (self.pg, *self._subpgs.values()):
                    if comm is not None:
                        self.backend.abandon(comm, work)
                return GenerationMovedError(
                    f"generation {self.generation} was left while a collective waited "
                    "(the job moved to a new generation: a member was lost)"
                )
        except Exception as err:
            return err.with_traceback(None)

    # -- DDP -------------------------------------------------------------
    def attach(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        self._params = {id(p): i for i, p in enumerate(ddp.module.parameters())}

        def hook(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
            return self._hook(self, bucket)

        # DDP checks the annotations as objects; this module's are strings (PEP 563)
        hook.__annotations__ = {
            "state": object,
            "bucket": GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        ddp.register_comm_hook(self, hook)

    @staticmethod
    def _hook(self: GenerationGroup, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        try:
            self._pending.append((bucket, fut))
            if bucket.is_last():
                self._reduce_pending()
        except BaseException as err:  # never raise into DDP's reducer
            self.error = self.error or err
            self._release()
        return fut

    def _reduce_pending(self) -> None:
        views: list[tuple[int, torch.Tensor]] = []
        for bucket, _ in self._pending:
            buf = bucket.buffer()
            offset = 0
            for p in bucket.parameters():
                n = p.numel()
                views.append((self._params.get(id(p), 1 << 30), buf[offset : offset + n]))
                offset += n
        views.sort(key=lambda v: v[0])
        parts = [v for _, v in views]
        if self.signal_slot:  # the stop vote travels with the gradients
            parts.append(torch.full((1,), self.signal, dtype=parts[0].dtype))
        flat = torch.cat(parts)
        self.allreduce_(flat)
        if self.error is None:
            if self.signal_slot:
                self.signalled |= bool(flat[-1].item() > 0)
                flat = flat[:-1]
            flat.div_(self.world_size)
            offset = 0
            for _, v in views:
                n = v.numel()
                v.copy_(flat[offset : offset + n])
                offset += n
        self._release()

    def _release(self) -> None:
        pending, self._pending = self._pending, []
        for bucket, fut in pending:
            if not fut.done():
                fut.set_result(bucket.buffer())

    def reset_step(self) -> BaseException | None:
        """The error of the step that just ended (None: it succeeded); clears it."""
        err, self.error = self.error, None
        self._pending.clear()
        if err is not None:
            self.signalled = False  # a failed step decides nothing
        return err

    def close(self) -> None:
        self.drop()
