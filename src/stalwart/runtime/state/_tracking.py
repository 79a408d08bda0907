"""The training state a session tracks and the checkpoints that hold it.

:class:`TrackedState` owns the tracked objects (``sess.track(...)``), whether they are
replicated (a DDP job: one copy to persist, rank 0's), the rank's checkpoint manager
(snapshot slots and persister), the per-rank part of a replicated state
(runtime/state/_perrank.py) and a parked standby's preload (runtime/state/_standby.py).

Recording and opening are separate because a standby records its state at once but
opens its checkpoints only when activated: until then its slots on this host may still
be the live rank's.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from stalwart.compat.torch_optim import keep_lr_scheduler_mark
from stalwart.contract.shm_names import SlotNames
from stalwart.runtime.state._memory_tier import peer_slots, restore_memory_step

if TYPE_CHECKING:
    from stalwart.checkpoint import CheckpointManager, Snapshotter
    from stalwart.contract.env import WorkerEnv
    from stalwart.metrics.events import EventLog
    from stalwart.runtime.comm._formation import Position
    from stalwart.runtime.comm.group import GenerationGroup
    from stalwart.runtime.state._perrank import PerRankPart
    from stalwart.runtime.state._standby import Preload

__all__ = ["TrackedState", "guard_optimizer"]


class TrackedState:
    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self.names = SlotNames(env.job, env.shm_run)  # this job's /dev/shm slot names
        self.state: dict[str, Any] = {}
        self.replicated = False  # a DDP model is tracked: its state is a replica
        self.sharded = False  # DTensor parameters (FSDP2): one multi-rank checkpoint
        self.part: PerRankPart | None = None  # replicated: this rank's own state on disk
        self.preload: Preload | None = None  # a parked standby's (runtime/state/_standby.py)
        # HSDP: ranks of the same key hold the same shards (runtime/comm/_mesh.py copy_key)
        self.copy_key: int | None = None
        self._ckpt: CheckpointManager | None = None
        self._events: EventLog | None = None

    def record(self, state: Mapping[str, Any], group: GenerationGroup) -> dict[str, Any]:
        """``Session.track``: hook DDP models and guard optimizers on ``group``; the
        process RNGs are held here (as ``_rng``) unless the script tracks its own
        RNGState: one copy, never two of the same generators."""
        from stalwart.checkpoint import RNGState
        from stalwart.runtime.comm._fsdp import is_sharded
        from stalwart.runtime.comm._world import localize

        for value in state.values():
            if isinstance(value, torch.nn.parallel.DistributedDataParallel):
                localize(value)  # DDP over a local group, gradients through the hook
                group.attach(value)
            if isinstance(value, torch.optim.Optimizer):
                guard_optimizer(group, value)
        held = any(isinstance(v, RNGState) for v in state.values())
        self.state = {**state} if held else {**state, "_rng": RNGState()}
        self.replicated = any(
            isinstance(v, torch.nn.parallel.DistributedDataParallel) for v in state.values()
        )
        self.sharded = not self.replicated and is_sharded(state)
        return self.state

    def add(self, name: str, obj: Any) -> None:
        """A runtime part's own state, snapshotted, persisted and restored with the
        script's (``--strategy async``'s outer optimizer as ``_outer``): a name with a
        leading underscore, which a script's ``sess.track`` keywords do not use."""
        if not name.startswith("_") or name in self.state:
            raise ValueError(f"{name!r}: a runtime part's state needs a new '_' name")
        self.state[name] = obj

    @property
    def opened(self) -> bool:
        return self._ckpt is not None

    @property
    def checkpoints(self) -> CheckpointManager:
        if self._ckpt is None:
            raise RuntimeError("call Session.track(...) before Session.steps()")
        return self._ckpt

    @property
    def snapshots(self) -> Snapshotter:
        return self.checkpoints.snapshots

    def open(self, position: Position, events: EventLog | None) -> None:
        """The snapshot slots and the persister of ``position``'s rank."""
        from stalwart.checkpoint import CheckpointConfig, CheckpointManager, RetentionPolicy
        from stalwart.runtime.state._perrank import open_part
        from stalwart.runtime.state._tier_roots import tier_options

        env = self.env
        self._events = events
        run_dir = env.run_dir or os.path.abspath("stalwart-local")
        rank, world_size, sub = position.rank, position.world_size, []
        if env.replica_group is not None:  # async: each replica group its own checkpoint
            group, rank, world_size = env.replica_group
            sub = [f"group{group}"]
        # replicated (DDP) state: rank 0 persists the one copy; sharded (FSDP2) state:
        # every rank its shard into one multi-rank checkpoint (checkpoint/commit.py);
        # else (state of its own per rank) every rank its own one-rank checkpoint
        multi = self.sharded and world_size > 1
        own = not self.replicated and not multi and world_size > 1
        root = os.path.join(run_dir, "ckpt", *sub, *([f"rank{rank}"] if own else []))
        self._ckpt = ckpt = CheckpointManager(
            CheckpointConfig(
                root=root,
                namespace=self.names.rank(position.rank),  # /dev/shm: the launch rank's
                # a verified snapshot stays pinned for the digest checks
                # (runtime/integrity/_checks.py)
                slots=3 if env.sdc_every > 0 and self.replicated else 2,
                rank=rank if multi else 0,
                world_size=world_size if multi else 1,
                retention=RetentionPolicy(env.keep_last, env.keep_every or None),
                **tier_options(env, run_dir, root),
            )
        )
        for value in self.state.values():
            if isinstance(value, torch.optim.Optimizer):
                ckpt.snapshots.guard(value)
        # replicated: every rank persists its per-rank part (RNG, loader, values) beside
        if self.replicated and world_size > 1:
            self.part = open_part(ckpt, self.state, env, events, position, run_dir)
        persists = rank == 0 or not self.replicated or self.part is not None
        if env.persist_every != 0 and persists:
            ckpt.persister.start()  # now, not at the first persist (process start)

    def disk_step(self) -> int | None:
        """The newest committed step of this rank's checkpoint directory, or of the
        bucket tier it is copied to (``--ckpt-tier``: read from there directly)."""
        steps = self.checkpoints.steps()
        return steps[-1] if steps else None

    def restore_disk(self, step: int) -> int:
        """Load ``step`` from this rank's checkpoint on disk; returns the bytes read.

        A sharded checkpoint written by fewer ranks (a relaunch at a larger world size)
        has no index of this rank: its unsharded values, the process RNGs among them,
        come from rank ``rank % saved world``'s index, so two ranks would draw the same
        stream. Then this rank's RNG is derived from it, its rank and the step, as a DDP
        rank without its per-rank part gets (runtime/state/_perrank.py), with the same note."""
        from stalwart.runtime.state._perrank import derive_rng, note_derived

        ckpt = self.checkpoints
        result = ckpt.restore(self.state, step=step)
        rank = ckpt.config.rank
        if self.sharded and result.source_rank != rank:
            derive_rng(rank, result.step)
            why = f"the checkpoint was written by fewer ranks and holds no index of rank {rank}"
            note_derived(self._events, rank, result.step, "disk", why, source=result.source_rank)
        return result.bytes_read

    def restore_peer(
        self, target: int, holders: Iterable[tuple[int, Mapping[str, Any]]], who: str
    ) -> int:
        """Load step ``target`` from the slots of the first same-host member among
        ``holders`` ((name, published info), lowest name first) that holds it; returns
        the bytes read. Fixed and elastic recoveries both take the peer tier here."""
        peer = peer_slots(self.names, target, holders)
        if peer is None:
            raise RuntimeError(f"no snapshot of step {target} reachable from {who}")
        return restore_memory_step(peer, self.state, target)

    def close(self) -> None:
        if self._ckpt is not None:
            # under `stalwart run` the agent owns the slots (a replacement needs them)
            self._ckpt.close(unlink_snapshots=not self.env.managed)


def guard_optimizer(group: GenerationGroup, opt: torch.optim.Optimizer) -> None:
    """Skip ``opt.step`` in a step whose collective failed (the step is discarded
    everywhere and redone after the recovery).

    The guard is a method bound to ``opt`` (``__func__`` is what an LR scheduler built
    later wraps) and keeps torch's ``_wrapped_by_lr_sched`` mark when a scheduler built
    earlier had set it: otherwise the scheduler warns that ``optimizer.step()`` was
    overridden after its initialization. Nothing is added to the optimizer's
    ``state_dict()`` (it holds only ``state`` and ``param_groups``)."""
    if getattr(opt.step, _GUARDED, False):
        return  # tracked twice: one guard is enough
    original = opt.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if group.error is not None:
            return None  # the step failed somewhere: discard it everywhere
        return original(*args, **kwargs)

    setattr(step, _GUARDED, True)
    keep_lr_scheduler_mark(original, step)
    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]


_GUARDED = "_stalwart_guarded"
