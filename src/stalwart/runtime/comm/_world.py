"""The job-wide default process group that ``stalwart.init()`` installs.

After ``stalwart.init()`` in a job of more than one worker, c10d's default group (what
``dist.all_reduce(x)``, ``dist.get_rank()`` and ``dist.get_world_size()`` use when no
``group=`` is given) is a :class:`JobProcessGroup`: a registered ``ProcessGroup`` of the
job's rank and size whose collectives run on the current generation's gloo group, like
the FSDP2 mesh's (runtime/comm/_fsdp.py). Unlike that one, it raises: a user collective in a
failed step raises :class:`~stalwart.errors.StepFailedError` (the step is recorded as
failed first, so ``Session.steps()`` discards and redoes it), never returns zeros. Under
elastic a resize installs a new one of the new size (:func:`follow`).

DDP is *not* run over it (docs/runtime.md says why): a DDP model is moved to a local
world-size-1 group when it is tracked (:func:`localize`) and its gradients go through
the generation's comm hook (runtime/comm/group.py). Its constructor ran before any member was
connected, so its two collectives (the parameter-shape check and the broadcast of
rank 0's state) are answered locally here, and the runtime makes the broadcast itself at
the first formation and compares a digest of the replicas at every formation
(runtime/comm/_replicas.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from stalwart.compat import torch_c10d, torch_ddp, warn_untested_torch
from stalwart.compat.torch_c10d import HashStore, python_process_group, register_group
from stalwart.errors import GroupNotFormedError, ProcessGroupInitError, StepFailedError
from stalwart.runtime.comm._fsdp import SwapProcessGroup, done_work

if TYPE_CHECKING:
    from stalwart.runtime.comm.group import GenerationGroup

__all__ = ["JobProcessGroup", "follow", "install", "localize", "uninstall"]

_BACKEND = "stalwart"
_INIT = c10d.init_process_group  # torch's, before any patch of ours


@python_process_group
class JobProcessGroup(SwapProcessGroup):
    """The default group of a stalwart job: the generation's members, and collectives
    that raise instead of recording silently."""

    def size(self) -> int:
        return self._gen.world_size

    def rank(self) -> int:
        return self._gen.rank

    def barrier(self, opts: Any = None) -> dist.Work:
        """Before the job's group formed, a barrier is answered at once on each rank: it
        carries no data, so nothing computed changes (``training_args.main_process_first()``
        and ``accelerator.main_process_first()`` put one before the first step; their
        ordering of the ranks' preprocessing is lost, each rank does its own). A
        replacement or a standby, alone before it joins, could never pass a real one."""
        gen = self._gen
        if gen.pg is None and gen.generation < 0 and gen.error is None:
            return _done([])
        return super().barrier(opts)

    @property
    def device_types(self) -> list[torch.device]:  # object collectives ask for it
        return [self._gen.backend.device]

    def __repr__(self) -> str:
        return f"JobProcessGroup({self._name!r}, rank={self.rank()}, size={self.size()})"

    def _run(self, op: Callable[[Any], Any], outputs: Sequence[torch.Tensor]) -> dist.Work:
        gen = self._gen
        if gen.error is not None:
            raise StepFailedError(
                f"a collective ran in a step that already failed ({_first_line(gen.error)}): "
                "its result would be wrong; let the loop go on (e.g. `except "
                "stalwart.StepFailedError: continue`) and the step is redone after recovery"
            )
        if gen.pg is None:
            if gen.generation < 0:
                return self._before_formation(op, outputs)
            gen.error = StepFailedError(f"the group of generation {gen.generation} was left")
            raise StepFailedError(
                f"a collective ran after generation {gen.generation}'s group was left (a "
                "member was lost): the step is redone after recovery"
            )
        if gen.on_collective is not None:
            gen.on_collective(True)
        try:
            try:
                err = gen.error_of(op(gen.pg))
            except Exception as failed:  # the call itself failed (no work to wait for)
                err = failed.with_traceback(None)
            if err is None:
                return _done(outputs)
            gen.error = err  # the session discards the step
            gen.drop()  # our sockets close: the other peers fail at once too
        finally:
            if gen.on_collective is not None:
                gen.on_collective(False)
        raise StepFailedError(
            f"a collective failed in generation {gen.generation} ({_first_line(err)}): a "
            "member was lost; let the loop go on (e.g. `except stalwart.StepFailedError: "
            "continue`) and the step is redone after recovery (uncaught, this worker exits "
            "and is replaced like a crash)"
        )

    def _before_formation(self, op: Callable[[Any], Any], outputs: Sequence[Any]) -> dist.Work:
        """DDP's constructor checks the parameters' shapes (an all-gather) and broadcasts
        rank 0's state before any member is connected: answered as if every member held
        this one's (the runtime broadcasts and compares at the formation instead).
        Anything else would be silently local: refused."""
        if _in_ddp_constructor():
            return op(_Mirror())  # type: ignore[no-any-return]
        raise GroupNotFormedError(
            "a collective ran on the default group before the job's group formed (at the "
            "first `for step in sess.steps(...)`): move it into the loop (e.g. under `if "
            "step == 1:`); a barrier (main_process_first()) is allowed; track a DDP model "
            "before the loop"
        )


@python_process_group
class _Mirror:
    """A one-member stand-in used before the formation (DDP's constructor only)."""

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        for outs, inp in zip(outputs, inputs, strict=True):
            for out in outs:
                out.copy_(inp)
        return _done([t for ts in outputs for t in ts])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return _done(tensors)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> dist.Work:
        out.copy_(inp.repeat(out.numel() // max(1, inp.numel())).view_as(out))
        return _done([out])


def _done(outputs: Sequence[torch.Tensor]) -> dist.Work:
    return done_work(list(outputs))


def _first_line(err: BaseException) -> str:
    return (str(err) or type(err).__name__).splitlines()[0]


def _in_ddp_constructor() -> bool:
    ddp = torch.nn.parallel.DistributedDataParallel
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), ddp):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


# -------------------------------------------------------------------- the default group
class _Installed:
    local: Any = None  # the world-size-1 group DDP runs over
    job: JobProcessGroup | None = None
    gen: GenerationGroup | None = None
    size = 0  # the job group's size and rank when it was made (it is remade when either
    rank = 0  # changes)
    patched: list[tuple[Any, str, Any]] = []  # (namespace, name, original)


def _refuse_new_group(*args: Any, **kwargs: Any) -> Any:
    raise ProcessGroupInitError(
        "dist.new_group() on stalwart's default group is not supported: a sub-group "
        "would not follow the job's generations; use the default group, or "
        "`sess.mesh` for FSDP2"
    )


def _refuse_init(*args: Any, **kwargs: Any) -> None:
    raise ProcessGroupInitError(
        "torch.distributed.init_process_group() was called after stalwart.init(), which "
        "already made the job's default group: remove the call (dist.get_rank(), "
        "get_world_size() and collectives on the default group are the job's); a library "
        "that checks dist.is_initialized() first (Trainer, Accelerate) reuses it"
    )


def install(gen: GenerationGroup, job: str, caller: dict[str, Any] | None = None) -> None:
    """Make the job's default group: a local world-size-1 group for DDP, and, in a job
    of several workers, the :class:`JobProcessGroup` as c10d's default. Afterwards
    ``init_process_group`` (also a name the ``caller`` globals imported) raises. A
    group an earlier session of this process installed is replaced."""
    warn_untested_torch()  # a session's first use of torch's internals (stalwart.compat)
    if _Installed.local is not None and dist.group.WORLD in (
        _Installed.local,
        _Installed.job,
    ):
        uninstall()
    if dist.is_initialized():
        raise ProcessGroupInitError(
            "torch.distributed is already initialised (init_process_group ran before "
            "stalwart.init()): call stalwart.init() first and remove the "
            "init_process_group call; it makes the job's default group (build "
            "TrainingArguments or an Accelerator after it: they reuse it)"
        )
    _INIT("gloo", store=HashStore(), rank=0, world_size=1)
    _Installed.local = dist.group.WORLD
    _Installed.gen = gen
    follow(gen)
    _patch_init(caller)


def follow(gen: GenerationGroup) -> None:
    """At start and after every formation: the default group for the job's size now
    (a new one when the size or rank changed under elastic, so that c10d's own view,
    ``getSize`` in C++, matches too; the local group for a world of one)."""
    inst = _Installed
    if inst.gen is not gen:
        return
    if gen.world_size <= 1:
        if inst.job is not None:  # an elastic job shrank to one member
            _forget(inst.job)
            inst.job, inst.size = None, 1
            torch_c10d.set_default_group(inst.local)
        torch_c10d.set_group_ranks(inst.local, {0: 0})
        return
    if inst.job is not None and (inst.size, inst.rank) == (gen.world_size, gen.rank):
        return
    if not hasattr(dist.Backend, _BACKEND.upper()):
        dist.Backend.register_backend(_BACKEND, _refuse_new_group, devices=["cpu"])
    name = f"stalwart:{gen.namespace}:world:{gen.generation}"
    job = JobProcessGroup(gen, name)
    if inst.job is not None:
        _forget(inst.job)
    register_group(job, gen.store, {i: i for i in range(gen.world_size)}, _BACKEND)
    inst.job, inst.size, inst.rank = job, gen.world_size, gen.rank
    torch_c10d.set_default_group(job)
    # the local group maps our global (job) rank to its only rank
    torch_c10d.set_group_ranks(inst.local, {gen.rank: 0})


def _forget(pg: Any) -> None:
    torch_c10d.forget_group(pg)


def localize(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Run ``ddp`` over the local world-size-1 group (its gradients go through the
    generation's comm hook): its bucket rebuild and per-forward buffer broadcast would
    otherwise be collectives a replaced worker makes alone."""
    local = _Installed.local
    if local is not None and ddp.process_group is not local:
        torch_ddp.move_to_group(ddp, local)


def _patch_init(caller: dict[str, Any] | None) -> None:
    targets: list[Any] = [dist, c10d]
    if caller is not None:
        targets.append(caller)
    for ns in targets:
        get = ns.get if isinstance(ns, dict) else lambda k, ns=ns: getattr(ns, k, None)
        for key in ("init_process_group",):
            if get(key) is _INIT:
                _Installed.patched.append((ns, key, _INIT))
                if isinstance(ns, dict):
                    ns[key] = _refuse_init
                else:
                    setattr(ns, key, _refuse_init)


def uninstall() -> None:
    """Undo :func:`install` (tests; a process that ran several jobs in turn)."""
    for ns, key, original in reversed(_Installed.patched):
        if isinstance(ns, dict):
            ns[key] = original
        else:
            setattr(ns, key, original)
    _Installed.patched = []
    if _Installed.job is not None:
        _forget(_Installed.job)
    if dist.is_initialized():
        torch_c10d.set_default_group(_Installed.local)
        dist.destroy_process_group()
    _Installed.local = _Installed.job = _Installed.gen = None
    _Installed.size = 0
