"""The seam between a generation's group and the c10d backend that carries it.

:class:`~stalwart.runtime.comm.group.GenerationGroup` owns the generations (when a group is
formed, left and re-formed); a :class:`GroupBackend` owns what differs between gloo and
NCCL: how a generation's communicator is created over the job's store, how one collective
is issued with its own timeout, and what is done with a communicator that is left (a
collective failed, or the job moved to another generation while one waited). The
recovery strategies never see it: only the group does.

Only gloo is implemented (:class:`GlooBackend`). docs/runtime.md ("The backend seam")
names what an NCCL backend will need: aborting the communicator on a generation change
(``abandon``), rebuilding it at the next formation, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
and the blocking-wait caveats of ``Work.wait(timeout)``.

A communicator is a c10d ``Backend`` object (``ProcessGroupGloo`` ...): typed ``Any``
here because torch's stubs leave its collectives out.
"""

from __future__ import annotations

import ctypes
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["GLOO", "GlooBackend", "GroupBackend"]


class GroupBackend(Protocol):
    """What a generation group needs of a c10d backend."""

    name: str
    """c10d's name of the backend (``gloo``)."""
    device: torch.device
    """Where its collectives' tensors live (the job's default group reports it)."""

    def create(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        """The communicator of one generation, formed over ``store`` (a PrefixStore of
        the generation on the job's store); raises if a member is missing or fails.
        ``timeout`` bounds the formation and is the default of every collective."""
        ...

    def allreduce(self, comm: Any, tensors: list[torch.Tensor], timeout: timedelta) -> Any:
        """Start a sum over ``comm`` that may wait up to ``timeout`` for its peers (a
        step's allreduce waits longer than a formation); its ``Work``."""
        ...

    def abandon(self, comm: Any, work: Any) -> None:
        """The job moved to another generation while ``work`` waited on ``comm``: stop
        using it without blocking (its peers may be gone for good)."""
        ...

    def drop(self, comm: Any) -> None:
        """``comm`` is no longer used (a collective on it failed, the next generation is
        being formed, or the group closes): release it so that its peers fail fast."""
        ...

    def at_exit(self) -> None:
        """The process is ending: never block its exit on a communicator left behind."""
        ...


class GlooBackend:
    """Gloo: a communicator is a ``ProcessGroupGloo`` whose sockets close when the last
    reference goes, which is what makes the peers of a failed one fail within
    milliseconds. A left one cannot be cancelled: destroying it joins its worker threads,
    which wait for the dead peer until the collective's timeout; so an abandoned one is
    kept alive until its work ends (:meth:`abandon`), and leaked at exit."""

    name = "gloo"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self._graveyard: list[tuple[Any, Any]] = []  # (communicator, work) abandoned

    def create(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def allreduce(self, comm: Any, tensors: list[torch.Tensor], timeout: timedelta) -> Any:
        opts = dist.AllreduceOptions()
        opts.timeout = timeout
        return comm.allreduce(tensors, opts)

    def abandon(self, comm: Any, work: Any) -> None:
        self._graveyard[:] = [(c, w) for c, w in self._graveyard if not w.is_completed()]
        self._graveyard.append((comm, work))

    def drop(self, comm: Any) -> None:
        """Nothing to do: the caller drops its reference and the sockets close."""

    def at_exit(self) -> None:
        for pair in self._graveyard:
            if not pair[1].is_completed():  # the OS reclaims it; a destructor would block
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pair[0]))
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pair[1]))


GLOO = GlooBackend()
"""The process's gloo backend (it owns the communicators abandoned in this process)."""
