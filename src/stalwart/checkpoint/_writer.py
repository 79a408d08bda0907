"""Write one rank's shard (pack + index) and commit a step (manifest). No torch here.

Order of writes, which is what makes a checkpoint "committed and verifiable, or
invisible": pack (fsync, rename) -> rank index (atomic) -> manifest (atomic, last; under
a coordinator: pending name -> fenced record -> rename, see :func:`publish_step`).
A manifest is only written after every rank's index exists and every pack it references
is present, so a visible manifest never points at bytes that are not durable.
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.checkpoint.format import (
    PENDING_PREFIX,
    ChunkRef,
    IndexRef,
    Manifest,
    RankIndex,
    TensorEntry,
    checksum,
    index_path,
    manifest_path,
    pack_path,
    step_dir,
)
from stalwart.checkpoint.storage import Storage
from stalwart.errors import CheckpointError, FencedError, StepCommittedError

__all__ = ["DEFAULT_CHUNK_BYTES", "RankWrite", "known_chunks", "publish_step", "write_rank"]

DEFAULT_CHUNK_BYTES = 4 << 20
"""4 MiB: large enough that per-chunk overhead is noise at disk speed, small enough that
a frozen block inside a partly trained tensor still deduplicates."""


_Piece = tuple[int, int, int, int]  # (tensor, chunk index, slot offset, length)


@dataclass
class RankWrite:
    index: RankIndex
    written_bytes: int
    seconds: float


class _PackOut:
    """Appends chunks to a pack so that direct I/O sees whole, aligned blocks, and
    writes on a second thread so that hashing the next chunk overlaps the disk.

    Direct I/O needs aligned buffers, lengths and file offsets. Full chunks of a tensor
    are whole 4 KiB blocks at aligned slot addresses, so they are written straight from
    shared memory (no copy) whenever nothing is pending in the bounce buffers. Any other
    piece (a tensor's tail), and what follows it until the buffer fills, goes through
    two reused, page-aligned bounce buffers written in whole blocks; the last block is
    padded and the file truncated back. The pack has no padding, so every byte of a
    new pack belongs to a chunk and is covered by its hash."""

    MAX_RUN = 32 << 20
    """Adjacent full chunks of a tensor are written as one run of up to 32 MiB."""

    def __init__(self, stream: Any, data: memoryview, bounce_bytes: int = 8 << 20) -> None:
        self.stream = stream
        self._data = data
        self._run_at = 0  # a run of whole aligned chunks not yet handed to the writer
        self._run_len = 0
        self.align = int(getattr(stream, "alignment", 1))
        self.pos = 0  # logical bytes in the pack
        self._bounces = [mmap.mmap(-1, bounce_bytes) for _ in range(2)]
        self._free: queue.Queue[int] = queue.Queue()
        for b in range(len(self._bounces)):
            self._free.put(b)
        self._cur = self._free.get()
        self._used = 0  # bytes waiting in the current bounce buffer
        self._queued = 0  # bytes handed to the writer thread (always whole blocks)
        self._jobs: queue.Queue[tuple[memoryview, int | None] | None] = queue.Queue(maxsize=4)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._writer, name="stalwart-pack-writer")
        self._thread.start()

    def _writer(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            view, bounce = job
            try:
                if self._error is None:
                    self.stream.write(view)
            except BaseException as err:  # re-raised on the caller's thread
                self._error = err
            finally:
                view.release()
                if bounce is not None:
                    self._free.put(bounce)

    def _submit(self, view: memoryview, bounce: int | None) -> None:
        if self._error is not None:
            raise self._error
        self._jobs.put((view, bounce))
        self._queued += len(view)

    def put(self, piece: memoryview, at: int) -> int:
        """Append ``piece`` (which starts at byte ``at`` of a page-aligned slot);
        returns its offset in the pack."""
        n = len(piece)
        if self._used == 0 and at % self.align == 0 and n % self.align == 0:
            offset = self._queued + self._run_len
            run_end = self._run_at + self._run_len
            if self._run_len and at == run_end and self._run_len + n <= self.MAX_RUN:
                self._run_len += n  # contiguous in the slot: one larger write
            else:
                self._flush_run()
                self._run_at, self._run_len = at, n
            self.pos += n
            return offset
        self._flush_run()
        offset = self._queued + self._used
        view = piece
        while view:
            buf = self._bounces[self._cur]
            k = min(len(buf) - self._used, len(view))
            buf[self._used : self._used + k] = view[:k]
            self._used += k
            view = view[k:]
            if self._used == len(buf):
                self._drain(self._used)
        self.pos += n
        return offset

    def _flush_run(self) -> None:
        if self._run_len:
            self._submit(self._data[self._run_at : self._run_at + self._run_len], None)
            self._run_len = 0

    def _drain(self, nbytes: int) -> None:
        self._submit(memoryview(self._bounces[self._cur])[:nbytes], self._cur)
        self._cur = self._free.get()
        self._used = 0

    def finish(self) -> None:
        """Write everything; the pack's length is then exactly ``pos``."""
        self._flush_run()
        used = self._used
        if used:
            padded = -(-used // self.align) * self.align
            self._bounces[self._cur][used:padded] = bytes(padded - used)
            self._drain(padded)
        self._stop()
        if self._error is not None:
            raise self._error
        truncate = getattr(self.stream, "truncate", None)
        if self._queued != self.pos and truncate is not None:
            truncate(self.pos)

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def close(self) -> None:
        self._stop()
        for b in self._bounces:
            with contextlib.suppress(BufferError):  # a traceback may still hold a slice
                b.close()


def write_rank(
    storage: Storage,
    *,
    step: int,
    rank: int,
    world_size: int,
    tree: Any,
    layout: list[dict[str, Any]],
    data: memoryview,
    known: dict[str, ChunkRef],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Callable[[int, int], None] | None = None,
    copy_of: int | None = None,
) -> RankWrite:
    """Write the chunks of ``data`` that ``known`` does not already hold into a new pack,
    then the rank index. ``known`` (hash -> stored chunk) is updated in place.
    ``copy_of``: this rank's DTensor shards are rank ``copy_of``'s (an HSDP replica):
    their entries name that rank and no bytes of theirs are written.

    Raises :class:`StepCommittedError` when ``step`` is already committed: its manifest
    lists this rank's index by checksum, so rewriting the index in place would break the
    committed step until (unless) a new manifest is written (the caller skips it)."""
    if storage.exists(manifest_path(step)):
        raise StepCommittedError(
            f"step {step} is already committed in {storage.url}: a committed step is never "
            "rewritten (its manifest names each rank's index by checksum); skip the persist "
            'of a committed step (docs/checkpoint-format.md, "A committed step is immutable")'
        )
    t0 = time.perf_counter()
    pack = pack_path(step, rank, uuid.uuid4().hex[:8])
    stream = storage.open_stream(pack)
    out = _PackOut(stream, data)
    try:
        refs = _write_chunks(out, data, layout, pack, known, chunk_bytes, progress, copy_of)
        entries = _entries(layout, refs, copy_of)
        out.finish()
        out.close()
        pos = out.pos
        if pos:
            stream.commit()
        else:
            stream.abort()
    except BaseException:
        out.close()
        stream.abort()
        for h in [h for h, r in known.items() if r.pack == pack]:
            del known[h]
        raise
    index = RankIndex(step, rank, world_size, tree, entries, new_bytes=pos)
    storage.write_atomic(index_path(step, rank), index.encode())
    return RankWrite(index, pos, time.perf_counter() - t0)


def _pieces(
    layout: list[dict[str, Any]], chunk_bytes: int, align: int, copy_of: int | None
) -> list[_Piece]:
    """Every chunk as (tensor, chunk index, slot offset, length). Whole aligned blocks
    go first, the rest (tensor tails, tiny tensors such as optimizer step counters)
    last: the first kind is written straight from the slot in long runs, and the second
    cannot then interrupt a run or push the chunks after it through the bounce buffer."""
    pieces: list[_Piece] = []
    for ei, e in enumerate(layout):
        off, nbytes = int(e["offset"]), int(e["nbytes"])
        if copy_of is not None and e.get("shard"):
            continue  # its bytes are in rank copy_of's pack
        for ci, start in enumerate(range(0, nbytes, chunk_bytes)):
            pieces.append((ei, ci, off + start, min(chunk_bytes, nbytes - start)))
    pieces.sort(key=lambda p: p[2] % align != 0 or p[3] % align != 0)  # stable
    return pieces


def _write_chunks(
    out: _PackOut,
    data: memoryview,
    layout: list[dict[str, Any]],
    pack: str,
    known: dict[str, ChunkRef],
    chunk_bytes: int,
    progress: Callable[[int, int], None] | None,
    copy_of: int | None,
) -> list[dict[int, ChunkRef]]:
    """Hash every chunk, append the ones ``known`` lacks to the pack (``known`` grows);
    returns each tensor's chunk refs by chunk index (none for an HSDP replica's copy)."""
    pieces = _pieces(layout, chunk_bytes, out.align, copy_of)
    total = sum(p[3] for p in pieces)
    done = 0
    refs: list[dict[int, ChunkRef]] = [{} for _ in layout]
    for ei, ci, at, n in pieces:
        piece = data[at : at + n]
        h = checksum(piece)
        ref = known.get(h)
        if ref is None or ref.length != n:
            ref = ChunkRef(h, pack, out.put(piece, at), n)
            known[h] = ref
        refs[ei][ci] = ref
        done += n
        if progress is not None:
            progress(done, total)
    return refs


def _entries(
    layout: list[dict[str, Any]], refs: list[dict[int, ChunkRef]], copy_of: int | None
) -> list[TensorEntry]:
    return [
        TensorEntry(
            id=int(e["id"]),
            path=str(e["path"]),
            dtype=str(e["dtype"]),
            shape=[int(x) for x in e["shape"]],
            nbytes=int(e["nbytes"]),
            chunks=[refs[ei][ci] for ci in range(len(refs[ei]))],
            shard=e.get("shard"),
            copy_of=copy_of if copy_of is not None and e.get("shard") else None,
        )
        for ei, e in enumerate(layout)
    ]


def publish_step(
    storage: Storage,
    step: int,
    world_size: int,
    *,
    generation: int = 0,
    replicated: bool = False,
    meta: dict[str, Any] | None = None,
    is_current: Callable[[int], bool] | None = None,
    record: Callable[[Manifest], object] | None = None,
    pause: Callable[[str], None] | None = None,
) -> Manifest:
    """Publish ``step`` on disk: write its manifest once every rank's index is there
    (on disk; :meth:`stalwart.coordinator.Coordinator.commit_step` is the store's
    record of a trained step, a different thing).

    ``is_current(generation)`` is an early check: a member of an old generation gets
    :class:`FencedError` and nothing is written. ``record`` is the fence itself (the
    coordinator's compare-and-swap on the generation, which raises FencedError when it
    is stale): with it, the manifest is written under a pending name, ``record`` is
    called, and only then is the manifest renamed to ``MANIFEST.json``, so a member
    stopped anywhere before its compare-and-swap can never make the step visible.
    ``pause(stage)`` (tests) runs after the check (``"checked"``) and after the record
    (``"recorded"``)."""
    if is_current is not None and not is_current(generation):
        raise FencedError(
            f"generation {generation} is no longer current: this member was fenced and may not "
            f"commit step {step}; rejoin the job to get the current generation"
        )
    if pause is not None:
        pause("checked")
    manifest = _build_manifest(storage, step, world_size, generation, replicated, meta)
    if record is None:
        storage.write_atomic(manifest_path(step), manifest.encode())
        return manifest
    pending = f"{step_dir(step)}/{PENDING_PREFIX}{generation}.{uuid.uuid4().hex[:8]}.json"
    storage.write_atomic(pending, manifest.encode())
    try:
        record(manifest)
    except BaseException:
        storage.delete(pending)
        raise
    if pause is not None:
        pause("recorded")
    storage.rename(pending, manifest_path(step))
    return manifest


def _build_manifest(
    storage: Storage,
    step: int,
    world_size: int,
    generation: int,
    replicated: bool,
    meta: dict[str, Any] | None,
) -> Manifest:
    refs: list[IndexRef] = []
    packs: set[str] = set()
    total = new = 0
    for rank in range(world_size):
        path = index_path(step, rank)
        try:
            raw = storage.read(path)
        except FileNotFoundError as err:
            raise CheckpointError(
                f"cannot commit step {step}: rank {rank} has not written {path}; "
                "commit after every rank's persist finished"
            ) from err
        index = RankIndex.decode(raw, path)
        refs.append(IndexRef(rank, path, checksum(raw), len(raw)))
        packs |= index.packs
        total += index.nbytes
        new += index.new_bytes
    present = set(storage.listdir("data"))
    missing = sorted(p for p in packs if p.rsplit("/", 1)[-1] not in present)
    if missing:
        raise CheckpointError(
            f"cannot commit step {step}: referenced pack files are missing: "
            + ", ".join(missing[:5])
        )
    return Manifest(
        step=step,
        world_size=world_size,
        indexes=refs,
        packs=sorted(packs),
        total_bytes=total,
        new_bytes=new,
        created_unix=time.time(),
        generation=generation,
        replicated=replicated,
        meta=dict(meta or {}),
    )


def known_chunks(storage: Storage, manifest: Manifest | None) -> dict[str, ChunkRef]:
    """Every chunk a committed checkpoint references: the base for deduplication."""
    known: dict[str, ChunkRef] = {}
    if manifest is None:
        return known
    for ref in manifest.indexes:
        index = RankIndex.decode(storage.read(ref.path), ref.path)
        for t in index.tensors:
            for c in t.chunks:
                known[c.hash] = c
    return known
