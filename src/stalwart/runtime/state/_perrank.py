"""The per-rank part of a replicated (DDP) job's state, on disk.

A DDP job persists one copy of the replicated state (rank 0's, in ``<run>/ckpt``). What
is not replicated is persisted by every rank beside it, from its own snapshot slot, into
``<run>/ckpt/per-rank/rank<member:05d>`` (a one-rank checkpoint of the same format):
the process RNGs (``RNGState``), loaders, tracked dicts and any other tracked object that
is not a module, an optimizer or an LR scheduler (those are replicas). A disk restore
loads rank 0's full state, then the rank's own part of the same step over it.

Where a rank has no part of the agreed step (a checkpoint written before per-rank parts
existed, a member that never persisted one, or a peer-tier restore after its node was
lost), it keeps rank 0's values for the part's objects (a stalwart loader's state is
rank-independent) and gets process RNGs *derived* from rank 0's restored RNG, the rank
and the step: distinct per rank and reproducible, but not the stream the fault-free run
drew; a note event and a line on stderr say so (docs/porting.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from stalwart.checkpoint import committed_steps, open_storage, restore_state
from stalwart.errors import CheckpointError, StorageUnavailableError, UnsupportedStateError
from stalwart.logs import get_logger
from stalwart.runtime.state._tier_roots import tier_options

if TYPE_CHECKING:
    from stalwart.checkpoint import CheckpointManager
    from stalwart.contract.env import WorkerEnv
    from stalwart.metrics.events import EventLog
    from stalwart.runtime.comm._formation import Position

__all__ = [
    "PerRankPart",
    "check_values",
    "derive_rng",
    "note_derived",
    "open_part",
    "per_rank_names",
]

_log = get_logger(__name__)

_KEEP_LAST = 16  # steps of the part kept: tiny, and more than rank 0 keeps (see persist)


def per_rank_names(state: Mapping[str, Any]) -> list[str]:
    """Tracked names whose objects are not replicas in a DDP job."""
    replica = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    return [name for name, obj in state.items() if not isinstance(obj, replica)]


def check_values(state: Mapping[str, Any]) -> None:
    """Refuse, at ``track()``, a tracked dict holding something a checkpoint cannot store
    (no pickle: docs/checkpoint-format.md), rather than at the first snapshot."""
    for name, obj in state.items():
        if isinstance(obj, dict):
            _check_value(obj, name)


_SCALARS = (type(None), bool, int, float, str, bytes, torch.Tensor, torch.dtype)


def _check_value(obj: Any, path: str) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_value(k, f"{path}.<key>")
            _check_value(v, f"{path}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _check_value(v, f"{path}[{i}]")
    elif not isinstance(obj, _SCALARS) and type(obj).__module__ != "numpy":
        raise UnsupportedStateError(
            f"tracked {path} is a {type(obj).__name__}: a tracked dict holds numbers, "
            "strings, bools, None, bytes, tensors, numpy arrays and lists/tuples/dicts of "
            "those (stored without pickle); convert it or track an object with state_dict()"
        )


def derive_rng(rank: int, step: int) -> None:
    """Seed this process's RNGs from the current torch RNG state, ``rank`` and ``step``."""
    base = torch.get_rng_state().numpy().tobytes()
    digest = hashlib.blake2b(base + f"stalwart:{rank}:{step}".encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little") >> 1
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (1 << 32))
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass


class PerRankPart:
    def __init__(
        self,
        ckpt: CheckpointManager,
        state: Mapping[str, Any],
        env: WorkerEnv,
        events: EventLog | None,
        position: Position,
        root: str,
        names: list[str],
        run_dir: str = "",
    ) -> None:
        self.ckpt = ckpt
        self.state = state
        self.env = env
        self.events = events
        self.position = position  # the live rank: rank 0's disk copy is its own state
        self.storage = open_storage(root)
        tier = tier_options(env, run_dir, root)  # the bucket tier: read directly
        self.tiers = [open_storage(u, s3=tier["tier_s3"]) for u in tier.get("tiers", ())]
        self.names = names
        self.member = position.rank  # the launch rank (under elastic: the member's name)
        self._warned = False

    def steps(self) -> list[int]:
        found = set(committed_steps(self.storage))
        for tier in self.tiers:  # the bucket tier (down: adds none)
            with contextlib.suppress(StorageUnavailableError):
                found |= set(committed_steps(tier))
        return sorted(int(s) for s in found)

    def disk_steps(self, shared: list[int]) -> list[int]:
        """The persisted steps this rank can restore completely: committed in the shared
        checkpoint and in its own part (all shared ones when it has no part at all, as
        with a checkpoint written before parts existed: the part is then derived)."""
        own = set(self.steps())
        return [s for s in shared if s in own] if own else list(shared)

    def persist(self, step: int) -> None:
        """Queue the part of the newest snapshot (that of ``step``) for persisting."""
        env = self.env
        # at least what the shared checkpoint keeps (its milestones too): every step a
        # restore may pick must find this rank's part beside it
        fut = self.ckpt.persist_part(
            self.storage,
            self.names,
            keep_last=max(_KEEP_LAST, env.keep_last),
            keep_every=env.keep_every or None,
        )
        events = self.events

        def done(f: Any) -> None:
            err = f.exception()
            if err is not None and events is not None:
                events.emit(
                    "note",
                    message=f"rank {self.member}: per-rank state of step {step} not "
                    f"persisted: {str(err).splitlines()[0]}",
                )

        fut.add_done_callback(done)

    def restore(self, step: int, tier: str) -> None:
        """After the replicated state of ``step`` was loaded from rank 0's copy (disk) or
        a peer's slots: load this rank's own part of ``step``, else derive it."""
        if step in self.steps():
            part = {name: self.state[name] for name in self.names}
            try:
                restore_state(self.storage, part, step=step, slower=self.tiers)
                return
            except CheckpointError as err:
                why = f"its per-rank part does not load ({str(err).splitlines()[0]})"
        elif tier == "disk" and self.position.rank == 0:
            return  # the shared copy is rank 0's own state (a checkpoint from before parts)
        else:
            why = "no per-rank part of that step was persisted by this rank"
        derive_rng(self.member, step)
        self._note(step, tier, why)

    def _note(self, step: int, tier: str, why: str) -> None:
        note_derived(self.events, self.member, step, tier, why, warn=not self._warned)
        self._warned = True


def note_derived(
    events: EventLog | None,
    rank: int,
    step: int,
    tier: str,
    why: str,
    *,
    source: int = 0,
    warn: bool = True,
) -> None:
    """The note event (and, with ``warn``, the stderr line) of a rank whose RNG was
    derived (:func:`derive_rng`) from rank ``source``'s restored one."""
    message = (
        f"rank {rank}: restored step {step} from the {tier} tier, but {why}: its RNG is "
        f"derived from rank {source}'s (per rank, not the fault-free stream) and its "
        f"other per-rank values are rank {source}'s"
    )
    if events is not None:
        events.emit("note", message=message)
    if warn:
        _log.warning("%s", message)


def open_part(
    ckpt: CheckpointManager,
    state: Mapping[str, Any],
    env: WorkerEnv,
    events: EventLog | None,
    position: Position,
    run_dir: str,
) -> PerRankPart | None:
    """The part of a replicated job with more than one rank (the caller checks that):
    None when every tracked object is a replica."""
    names = per_rank_names(state)
    root = os.path.join(run_dir, "ckpt", "per-rank", f"rank{position.rank:05d}")
    return PerRankPart(ckpt, state, env, events, position, root, names, run_dir) if names else None
