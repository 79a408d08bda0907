"""Restore a tracked state from persisted checkpoints, verifying every byte read.

Newest committed step first; a step whose manifest, index or any chunk fails its
checksum (or is missing) is reported and the next older one is tried. Chunks are read
straight into the state's existing tensors and hashed there (one pass over the bytes),
so a corrupt newer checkpoint may leave the state partly written before the older one
overwrites all of it; if none loads, :class:`CheckpointCorruptError` lists every problem.

World size changes: replicated state (DDP) comes from any rank; DTensor shards are
re-cut from the saved shards' boxes (global offsets recorded at save time).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.checkpoint._layout import layout_problems
from stalwart.checkpoint._load import SavedTensor, allocate, byte_view, load_into
from stalwart.checkpoint._readplan import ReadPlan
from stalwart.checkpoint.catalog import committed_steps, load_index, load_manifest
from stalwart.checkpoint.format import (
    QUARANTINE_DIR,
    QUARANTINE_NAME,
    Manifest,
    RankIndex,
    TensorEntry,
    manifest_path,
    step_dir,
)
from stalwart.checkpoint.storage import Storage
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    StorageUnavailableError,
)

__all__ = ["RestoreResult", "quarantine", "read_into", "read_tensor", "restore_state"]


@dataclass
class RestoreResult:
    step: int
    skipped: list[str] = field(default_factory=list)  # problems of newer steps passed over
    bytes_read: int = 0
    quarantined: list[str] = field(default_factory=list)  # where damaged steps were moved
    source_rank: int = 0
    """The saved rank whose index was loaded (tree and unsharded values such as RNG
    states): the restoring rank itself, or ``rank % saved world`` when the checkpoint
    was written by fewer ranks (the caller then derives what must differ per rank)."""
    tier: str = ""
    """The URL of the tier the step was read from (the local root, or a bucket)."""


def _read_entry(
    storage: Storage, t: TensorEntry, dst: torch.Tensor, pool: ThreadPoolExecutor
) -> None:
    """Read and verify ``t``'s chunks into ``dst`` (its chunks in parallel on ``pool``)."""
    pending: list[Future[None]] = []
    plan = ReadPlan(storage, pool)
    plan.add(t, byte_view(dst))
    plan.submit(pending)
    _drain(pending)


def _drain(pending: list[Future[None]]) -> None:
    """Wait for every queued read (none may still write into the state afterwards, even
    when one failed and an older checkpoint is tried next); raise the first error."""
    errors = []
    for fut in pending:
        try:
            fut.result()
        except Exception as err:
            errors.append(err)
    pending.clear()
    if errors:
        raise errors[0]


def _drain_quietly(pending: list[Future[None]]) -> None:
    for fut in pending:
        fut.exception()
    pending.clear()


def read_tensor(storage: Storage, t: TensorEntry, pool: ThreadPoolExecutor) -> torch.Tensor:
    """A verified copy of one saved tensor (used by resharding and export)."""
    out = allocate(t.shape, getattr(torch, t.dtype), t.path)
    _read_entry(storage, t, out, pool)
    return out


def read_into(
    storage: Storage, t: TensorEntry, dst: torch.Tensor, pool: ThreadPoolExecutor
) -> None:
    """Read and verify one saved tensor into ``dst`` (contiguous, CPU, its byte size):
    export assembles shards in place with it, without a copy per shard."""
    _read_entry(storage, t, dst, pool)


def _saved(t: TensorEntry) -> SavedTensor:
    return SavedTensor(t.id, t.path, t.dtype, t.shape, t.nbytes, t.shard)


def _restore_step(
    storage: Storage, state: Mapping[str, Any], step: int, rank: int, world_size: int
) -> tuple[int, int]:
    manifest = load_manifest(storage, step)
    src_rank = rank if rank < manifest.world_size else rank % manifest.world_size
    indexes = _step_indexes(storage, manifest, step)
    primary = indexes[src_rank]
    by_id = {t.id: t for t in primary.tensors}
    prefetch = getattr(storage, "prefetch", None)
    if prefetch is not None:
        for pack in sorted(primary.packs):
            prefetch(pack)

    # an object store hides its per-request latency with more reads in flight (S3Config)
    with ThreadPoolExecutor(max_workers=int(getattr(storage, "read_threads", 4))) as pool:
        pending: list[Future[None]] = []
        plan = ReadPlan(storage, pool)  # on an object store: large ranged reads per pack

        def reshard(entry: SavedTensor, dst: torch.Tensor, box: dict[str, list[int]]) -> None:
            pieces = [
                t
                for idx in indexes
                for t in idx.tensors
                if t.path == entry.path and t.copy_of is None  # a copy has no bytes
            ]
            _fill_box(storage, pieces, dst, box, pool)

        def fill(entry: SavedTensor, dst: torch.Tensor) -> None:
            saved = by_id[entry.id]
            if saved.copy_of is not None and saved.shard is not None:
                reshard(entry, dst, saved.shard)  # the bytes are in the peer's pack
                return
            plan.add(saved, byte_view(dst))

        def finish() -> None:
            plan.submit(pending)
            _drain(pending)

        try:
            load_into(
                state, primary.tree, [_saved(t) for t in primary.tensors], fill, reshard, finish
            )
        finally:
            _drain_quietly(pending)
    return primary.nbytes, src_rank


def _step_indexes(storage: Storage, manifest: Manifest, step: int) -> list[RankIndex]:
    """Every rank's index of ``step``, its layout checked across them (copies resolve,
    boxes tile exactly: checkpoint/_layout.py) before any byte is read. Checked whether
    or not this rank reads another's pieces: in the same layout each rank reads only its
    own, and a step damaged in another rank's boxes would otherwise load here and be
    skipped there (ranks resuming from different steps)."""
    indexes = [load_index(storage, manifest, r) for r in range(manifest.world_size)]
    problems = layout_problems(indexes)
    if problems:
        raise CheckpointCorruptError(f"step {step}: {problems[0]}", problems)
    return indexes


def _fill_box(
    storage: Storage,
    pieces: list[TensorEntry],
    dst: torch.Tensor,
    box: dict[str, list[int]],
    pool: ThreadPoolExecutor,
) -> None:
    """Copy into ``dst`` (the local shard at ``box``) every overlapping saved piece.

    Ranks that hold the same piece (replicated mesh dimensions, e.g. HSDP) saved it
    once each; one copy per box is read, so duplicates can neither be read twice nor
    make up for a piece that is missing."""
    unique: dict[tuple[tuple[int, ...], tuple[int, ...]], TensorEntry] = {}
    for piece in pieces:
        offsets = tuple(piece.shard["offsets"]) if piece.shard else (0,) * len(piece.shape)
        unique.setdefault((offsets, tuple(piece.shape)), piece)
    covered = 0
    for piece in unique.values():
        p_off = piece.shard["offsets"] if piece.shard else [0] * len(piece.shape)
        src_sl, dst_sl, n = [], [], 1
        for d in range(len(piece.shape)):
            lo = max(p_off[d], box["offsets"][d])
            hi = min(p_off[d] + piece.shape[d], box["offsets"][d] + dst.shape[d])
            if hi <= lo:
                n = 0
                break
            src_sl.append(slice(lo - p_off[d], hi - p_off[d]))
            dst_sl.append(slice(lo - box["offsets"][d], hi - box["offsets"][d]))
            n *= hi - lo
        if n == 0:
            continue
        src = read_tensor(storage, piece, pool)
        dst[tuple(dst_sl)] = src[tuple(src_sl)]
        covered += n
        if not piece.shard:
            break  # a whole tensor covers everything
    if covered < dst.numel():
        raise CheckpointCorruptError(
            f"saved shards of {pieces[0].path if pieces else '?'} do not cover the local shard "
            f"at offsets {box['offsets']}; the checkpoint is missing ranks"
        )


def quarantine(storage: Storage, step: int, problems: list[str]) -> str:
    """Make a damaged step invisible, keeping it and a record of why; returns where it
    went (``quarantine/step_<step>-<time>`` inside the root).

    Deduplication stores a shared chunk once, so a damaged chunk breaks every step that
    references it; a damaged step left visible would also be the base that the next
    save deduplicates against, and would spread the damage. Quarantined, it is neither
    restored nor used as a base, so the next save writes those chunks afresh."""
    record = {"step": step, "quarantined_unix": time.time(), "problems": problems}
    storage.write_atomic(f"{step_dir(step)}/{QUARANTINE_NAME}", json.dumps(record).encode())
    dest = f"{QUARANTINE_DIR}/{step_dir(step)}-{time.time_ns()}"
    try:
        storage.rename(step_dir(step), dest)  # the whole directory: one atomic move
    except (OSError, NotImplementedError):  # an object store has no directories to move
        storage.delete(manifest_path(step))
        return f"{step_dir(step)}/{QUARANTINE_NAME}"
    return dest


_BAD_STEP = (CheckpointCorruptError, CheckpointFormatError, OSError, EOFError)
"""What a damaged or crafted step can raise once every field is validated (the format
error covers unsafe paths too); anything else is a bug or a state that does not fit."""


def _candidates(
    tiers: Sequence[Storage], step: int | None, skipped: list[str]
) -> list[tuple[int, Storage]]:
    """Every (step, tier) a restore may read, newest step first and, for one step, the
    fastest tier holding it first. A slower tier that cannot be listed (the bucket down)
    is passed over with a line in ``skipped``; the first tier's errors are raised."""
    held: list[tuple[Storage, set[int]]] = []
    for i, tier in enumerate(tiers):
        try:
            held.append((tier, set(committed_steps(tier))))
        except StorageUnavailableError as err:
            if i == 0:
                raise
            skipped.append(f"{tier.url}: not listed ({str(err).splitlines()[0]})")
    steps = sorted({s for _, have in held for s in have}, reverse=True)
    if step is not None:
        steps = [s for s in steps if s == step]
    return [(s, tier) for s in steps for tier, have in held if s in have]


def restore_state(
    storage: Storage,
    state: Mapping[str, Any],
    *,
    rank: int = 0,
    world_size: int = 1,
    step: int | None = None,
    quarantine_damaged: bool = False,
    slower: Sequence[Storage] = (),
) -> RestoreResult:
    """Load the newest valid checkpoint (or exactly ``step``) into ``state``.

    ``slower``: further tiers of the same checkpoint (a bucket the local root is copied
    to), read directly, with no copy to ``storage`` first, for the steps ``storage``
    lacks (a fresh node, a lost disk); a step several tiers hold is read from the
    fastest. A step that is damaged or crafted (any :data:`_BAD_STEP`) on one tier is
    reported in ``skipped`` and the next (tier, step) is tried. ``quarantine_damaged``
    moves every such step of ``storage`` aside (see :func:`quarantine`; listed in
    ``quarantined``; a slower tier is only read, never changed). Only a job's single
    restorer should set it: ranks restoring in parallel must first agree on the step,
    or one rank could hide a step another just loaded."""
    skipped: list[str] = []
    candidates = _candidates([storage, *slower], step, skipped)
    if not candidates:
        raise CheckpointNotFoundError(
            f"{storage.url}: no committed checkpoint"
            + (f" at step {step}" if step is not None else "")
            + "".join(f" (nor in {t.url})" for t in slower)
            + "; start from scratch or pass the directory of a run that saved"
        )
    quarantined: list[str] = []
    for s, tier in candidates:
        try:
            nbytes, source = _restore_step(tier, state, s, rank, world_size)
            return RestoreResult(s, skipped, nbytes, quarantined, source, tier.url)
        except _BAD_STEP as err:
            problems = getattr(err, "problems", None) or [str(err).splitlines()[0]]
            where = f" ({tier.url})" if slower else ""
            skipped.extend(f"step {s}{where}: {p}" for p in problems)
            if quarantine_damaged and tier is storage:
                quarantined.append(quarantine(storage, s, problems))
    raise CheckpointCorruptError(
        f"no checkpoint in {storage.url} loads: " + "; ".join(skipped[:5]), skipped
    )
