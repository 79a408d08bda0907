"""Snapshots: copy a training state into pre-allocated shared-memory slots.

This is the only part of checkpointing that blocks training, so it does the least it can:
one ``copy_`` per tensor into memory that was allocated and pre-faulted once. With
``blocking=False`` the tensors that change only at the optimizer step (parameters and
optimizer state) are copied on a background thread while the next forward/backward runs;
the caller (or the optimizer pre-step hook installed by :meth:`Snapshotter.guard`) waits
only for what is left when the state is about to change. Everything else, model buffers
included, is copied before ``snapshot`` returns.

Slots are double-buffered (``SnapshotConfig.slots``, default 2): a copy never goes into
the newest complete slot while an older one exists to overwrite, and never into a slot
pinned by a persist in flight, so a crash mid-copy always leaves a complete snapshot.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.checkpoint._load import load_slot
from stalwart.checkpoint._shm import (
    SlotDirectory,
    SlotFiles,
    SlotMeta,
    check_fits,
    ensure_private_dir,
    latest_complete,
    pinned_slots,
)
from stalwart.checkpoint._state import capture, deferrable_ptrs, local_and_shard
from stalwart.checkpoint._tree import Leaf
from stalwart.contract.shm_names import SHM_DIR, slot_dir
from stalwart.errors import CheckpointNotFoundError, ConfigError

__all__ = ["SnapshotConfig", "SnapshotResult", "Snapshotter", "load_slot", "local_and_shard"]

_ALIGN = 4096


@dataclass(frozen=True)
class SnapshotConfig:
    """Where and how many slots. ``namespace`` names the slot directory; use one per
    (job, rank) so that a restarted worker finds its own snapshots again."""

    namespace: str
    slots: int = 2
    shm_dir: str = SHM_DIR

    def __post_init__(self) -> None:
        if self.slots < 2:
            raise ConfigError(f"snapshot slots={self.slots}: need at least 2 (double buffer)")
        if not self.namespace or "/" in self.namespace:
            raise ConfigError(
                f"snapshot namespace {self.namespace!r}: use a non-empty name without '/'"
            )


@dataclass
class SnapshotResult:
    step: int
    slot: int
    nbytes: int
    blocking_s: float  # time spent inside snapshot() and wait(): the training stall


class _Plan:
    """Offsets of every leaf in a slot; reused while dtypes and shapes stay the same."""

    def __init__(self, leaves: list[tuple[torch.Tensor, Leaf]]) -> None:
        self.key = [(t.dtype, tuple(t.shape)) for t, _ in leaves]
        self.offsets: list[int] = []
        pos = 0
        for t, _ in leaves:
            self.offsets.append(pos)
            nbytes = t.numel() * t.element_size()
            pos += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.size = pos
        self.views: dict[int, list[torch.Tensor]] = {}

    def layout(
        self, leaves: list[tuple[torch.Tensor, Leaf]], shards: list[dict[str, list[int]] | None]
    ) -> list[dict[str, Any]]:
        """The slot metadata's entry of every leaf (where its bytes are, what they are)."""
        return [
            {
                "id": i,
                "path": leaf.path,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "nbytes": t.numel() * t.element_size(),
                "offset": off,
                "shard": shard,
                "ndarray": leaf.is_ndarray,
            }
            for i, ((t, leaf), off, shard) in enumerate(
                zip(leaves, self.offsets, shards, strict=True)
            )
        ]

    def dst_views(
        self, slot: SlotFiles, leaves: list[tuple[torch.Tensor, Leaf]]
    ) -> list[torch.Tensor]:
        if slot.index not in self.views:
            buf = torch.frombuffer(slot.map_writable(self.size), dtype=torch.uint8)
            out = []
            for (t, _), off in zip(leaves, self.offsets, strict=True):
                n = t.numel() * t.element_size()
                out.append(buf[off : off + n].view(t.dtype).view(t.shape))
            self.views[slot.index] = out
        return self.views[slot.index]


class Snapshotter:
    """Writes snapshots of a tracked state into shared-memory slots and reads them back."""

    def __init__(self, config: SnapshotConfig) -> None:
        self.config = config
        self.directory = slot_dir(config.shm_dir, config.namespace)
        os.makedirs(os.path.dirname(self.directory), exist_ok=True)
        ensure_private_dir(self.directory)
        self._dir = SlotDirectory(self.directory)
        self._slots = self._dir.slots(config.slots)
        metas = [s.read_meta() for s in self._slots]
        self._seq = max((m.seq for m in metas if m is not None), default=0)
        # Sequence number of each complete slot (None: empty or being written). This
        # process is the slots' only writer, so it need not re-read their metadata to
        # choose one: that read was a large share of a small model's snapshot cost.
        self._slot_seq: dict[int, int | None] = {
            i: (m.seq if m is not None else None) for i, m in enumerate(metas)
        }
        self._plan: _Plan | None = None
        self._pinned: dict[int, int] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pending: SnapshotResult | None = None
        self._on_done: Callable[[SnapshotResult], None] | None = None
        self._copying = False  # a background copy has not finished yet
        self._after: list[Callable[[BaseException | None], None]] = []
        self._handover = threading.Lock()  # runs after_copy's calls one at a time, in order
        self._error: BaseException | None = None
        self._cuda_stream: Any = None

    # ---------------------------------------------------------------- writing
    def snapshot(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        blocking: bool = True,
        on_done: Callable[[SnapshotResult], None] | None = None,
    ) -> SnapshotResult:
        """Copy ``state`` into a free slot. With ``blocking=False`` the parameters and
        optimizer state are copied in the background; call :meth:`wait` (or use
        :meth:`guard`) before the optimizer changes them.

        ``on_done(result)`` runs once it is complete and its stall final: before this
        returns if nothing was deferred, else in the :meth:`wait` that joins the copy
        (optimizer pre-step hook, next snapshot, persist, close); never if it failed."""
        t0 = time.perf_counter()
        waited = self.wait()
        tree, raw_leaves = capture(state)
        pairs: list[tuple[torch.Tensor, Leaf]] = []
        shards: list[dict[str, list[int]] | None] = []
        for leaf in raw_leaves:
            local, shard = local_and_shard(leaf.tensor)
            pairs.append((local.detach(), leaf))
            shards.append(shard)
        plan = self._plan
        if plan is None or plan.key != [(t.dtype, tuple(t.shape)) for t, _ in pairs]:
            plan = self._plan = _Plan(pairs)
        slot = self._choose_slot()
        self._dir.check_own()
        check_fits(slot, plan.size, self.directory, step)  # before the slot is touched
        slot.invalidate()
        self._slot_seq[slot.index] = None
        dsts = plan.dst_views(slot, pairs)
        deferred_ptrs = deferrable_ptrs(state) if not blocking else set()
        now: list[tuple[torch.Tensor, torch.Tensor]] = []
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (src, _), dst in zip(pairs, dsts, strict=True):
            (later if src.data_ptr() in deferred_ptrs else now).append((src, dst))
        self._copy(now)
        self._seq += 1
        meta = SlotMeta(self._seq, step, tree, plan.layout(pairs, shards), plan.size)
        result = SnapshotResult(step, slot.index, plan.size, 0.0)
        if not later:
            self._finish(slot, meta)
            result.blocking_s = time.perf_counter() - t0 + waited
            if on_done is not None:
                on_done(result)
            return result
        self._pending = result
        self._on_done = on_done
        with self._cond:
            self._copying = True
        self._thread = threading.Thread(
            target=self._background, args=(later, slot, meta), name="stalwart-snapshot", daemon=True
        )
        self._thread.start()
        result.blocking_s = time.perf_counter() - t0 + waited
        return result

    def _background(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], slot: SlotFiles, meta: SlotMeta
    ) -> None:
        error: BaseException | None = None
        try:
            self._copy(pairs)
            self._finish(slot, meta)
        except BaseException as err:  # surfaced by wait()
            self._error = error = err
        with self._handover:
            with self._cond:
                self._copying = False
                after, self._after = self._after, []
            for fn in after:
                fn(error)

    def after_copy(self, fn: Callable[[BaseException | None], None]) -> None:
        """Run ``fn(error)`` once the snapshot in flight is complete (``error``: its
        copy's failure, else None): on the copying thread, or here at once when no copy
        is in flight. A persist is handed over this way, so the step loop does not wait
        for the copy. Calls run one at a time, in the order given."""
        with self._cond:
            if self._copying:
                self._after.append(fn)
                return
        with self._handover:
            fn(self._error)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cuda = [(s, d) for s, d in pairs if s.device.type == "cuda"]
        for src, dst in pairs:
            if src.device.type != "cuda":
                dst.copy_(src)
        if cuda:
            self._copy_cuda(cuda)

    def _copy_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Device-to-host copies on a side stream into the shared-memory slot.

        The slot's pages are registered as pinned host memory once (cudaHostRegister),
        so the copies run as real DMA without a second staging buffer."""
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream = self._cuda_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for src, dst in pairs:
                _ensure_pinned(dst)
                dst.copy_(src, non_blocking=True)
        stream.synchronize()

    def _finish(self, slot: SlotFiles, meta: SlotMeta) -> None:
        slot.publish(meta)
        self._slot_seq[slot.index] = meta.seq

    def wait(self) -> float:
        """Block until a background copy is complete; returns the seconds waited."""
        thread = self._thread
        if thread is None:
            return 0.0
        t0 = time.perf_counter()
        thread.join()
        self._thread = None
        waited = time.perf_counter() - t0
        done, on_done = self._pending, self._on_done
        self._pending = self._on_done = None
        if done is not None:
            done.blocking_s += waited
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if done is not None and on_done is not None:
            on_done(done)
        return waited

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for a background snapshot first."""

        def hook(*_: Any) -> None:
            self.wait()

        return optimizer.register_step_pre_hook(hook)

    def _choose_slot(self) -> SlotFiles:
        with self._cond:
            while True:
                held = {i for i, n in self._pinned.items() if n > 0}
                held |= pinned_slots(self.directory)  # elsewhere: a transfer from the agent
                free = [s for s in self._slots if s.index not in held]
                if free:
                    break
                self._cond.wait(timeout=1.0)
        # an empty slot first, else the oldest complete one
        seqs = {s.index: self._slot_seq.get(s.index) for s in free}
        return min(free, key=lambda s: (seqs[s.index] is not None, seqs[s.index] or -1))

    def reload(self) -> None:
        """Re-read the slots' metadata after another process wrote into them (a state
        transfer received into this namespace): the next snapshot then numbers itself
        after the received one and never overwrites the newest complete slot."""
        self.wait()
        metas = [s.read_meta() for s in self._slots]
        self._seq = max([self._seq, *(m.seq for m in metas if m is not None)])
        self._slot_seq = {i: (m.seq if m is not None else None) for i, m in enumerate(metas)}

    # ---------------------------------------------------------------- pinning
    def pin_latest(self, *, wait: bool = True) -> tuple[int, SlotMeta] | None:
        """Pin the newest complete slot (no snapshot overwrites it) for a persist (after
        the copy in flight; ``wait=False``: from :meth:`after_copy`, where it is done)."""
        if wait:
            self.wait()
        found = latest_complete(self.directory, self.config.slots)
        if found is not None:
            with self._cond:
                self._pinned[found[0]] = self._pinned.get(found[0], 0) + 1
        return found

    def discard_newer(self, step: int) -> None:
        """Invalidate the unpinned complete slots of steps after ``step``: a rollback to
        ``step`` (runtime/integrity/_checks.py) must not leave a later, corrupted or
        discarded, snapshot to be chosen by the next recovery."""
        self.wait()
        with self._cond:
            held = {i for i, n in self._pinned.items() if n > 0}
        for s in self._slots:
            meta = s.read_meta()
            if meta is not None and meta.step > step and s.index not in held:
                s.invalidate()
                self._slot_seq[s.index] = None

    def unpin(self, slot: int) -> None:
        with self._cond:
            self._pinned[slot] = max(0, self._pinned.get(slot, 0) - 1)
            self._cond.notify_all()

    # ---------------------------------------------------------------- reading
    def latest(self) -> SlotMeta | None:
        found = latest_complete(self.directory, self.config.slots)
        return found[1] if found else None

    def steps(self, *, wait: bool = True) -> list[int]:
        """Steps held by complete slots, oldest first (after any background copy; with
        ``wait=False`` a copy in flight is not waited for and its slot not counted)."""
        if wait:
            self.wait()
        metas = (s.read_meta() for s in self._slots)
        return sorted({m.step for m in metas if m is not None})

    def restore(self, state: Mapping[str, Any], *, step: int | None = None) -> int:
        """Load the newest complete snapshot (or the newest one of ``step``: flash
        recovery rolls back to the last step every member completed) into ``state``;
        returns its step."""
        self.wait()
        complete = [(s.index, m) for s in self._slots if (m := s.read_meta()) is not None]
        if step is not None:
            complete = [(i, m) for i, m in complete if m.step == step]
        if not complete:
            raise CheckpointNotFoundError(
                f"no complete snapshot{'' if step is None else f' of step {step}'} in "
                f"{self.directory}; restore from a persisted checkpoint"
            )
        index, meta = max(complete, key=lambda im: im[1].seq)
        load_slot(self._slots[index], meta, state)
        return meta.step

    def close(self, *, unlink: bool = False) -> None:
        """Release the mappings. ``unlink=True`` also deletes the slot files (the job's
        owner does this at the end; a crashed worker's snapshots must survive it)."""
        self.wait()
        if self._plan is not None:
            self._plan.views.clear()
        for s in self._slots:
            if unlink:
                s.unlink()
            else:
                s.close()
        if unlink and self._dir.is_own():  # never another owner's directory
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)


def _ensure_pinned(dst: torch.Tensor) -> None:  # pragma: no cover - needs a GPU
    base = dst.untyped_storage()
    key = base.data_ptr()
    if key in _PINNED:
        return
    rc = torch.cuda.cudart().cudaHostRegister(key, base.nbytes(), 0)  # type: ignore[no-untyped-call]
    if int(rc) == 0:
        _PINNED.add(key)


_PINNED: set[int] = set()
