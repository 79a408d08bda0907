"""Restore's chunk reads, coalesced into large ranged reads where the storage has them.

A restore queues every chunk it needs (tensor entry, chunk, destination bytes) and then
submits them at once. On a storage with ``read_ranges`` (an object store, where each
request costs a round trip and the store's own per-request work), the chunks of one pack
are sorted by offset and cut into runs of at most ``range_bytes`` each: one ranged read
per run, its bytes landing straight in the destination tensors chunk after chunk (a small
gap between chunks, alignment padding, lands in a scratch buffer), each chunk hashed as its
pieces land. Elsewhere (local disk) each chunk is one read, as before. Either way a chunk
is judged as :func:`~stalwart.checkpoint.catalog.read_chunk` judges it (same problem text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from stalwart.checkpoint.catalog import read_chunk
from stalwart.checkpoint.format import TensorEntry, new_hasher
from stalwart.checkpoint.storage import Storage
from stalwart.errors import CheckpointCorruptError, CheckpointFormatError

__all__ = ["ReadPlan"]

_MAX_GAP = 64 << 10  # padding between chunks read through rather than split at

ReadRanges = Callable[[str, int, Sequence[memoryview], Callable[[int, memoryview], None]], None]


@dataclass
class _Chunk:
    entry: TensorEntry
    index: int
    view: memoryview

    @property
    def offset(self) -> int:
        return self.entry.chunks[self.index].offset

    @property
    def end(self) -> int:
        return self.offset + len(self.view)


@dataclass
class _Run:
    pack: str
    chunks: list[_Chunk] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.chunks[-1].end


class ReadPlan:
    """Chunks to read into their destinations; :meth:`submit` queues the reads on
    ``pool`` and appends their futures (each raises CheckpointCorruptError for a chunk
    that is unreadable or fails its checksum)."""

    def __init__(self, storage: Storage, pool: ThreadPoolExecutor) -> None:
        self.storage, self.pool = storage, pool
        self.ranges: ReadRanges | None = getattr(storage, "read_ranges", None)
        self.range_bytes = int(getattr(storage, "read_range_bytes", 0))
        self._queued: list[_Chunk] = []

    def add(self, entry: TensorEntry, dst: memoryview) -> None:
        """Queue every chunk of ``entry`` into ``dst`` (its bytes, ``entry.nbytes`` long)."""
        if len(dst) != entry.nbytes:
            raise CheckpointFormatError(
                f"tensor {entry.path!r}: index says {entry.nbytes} bytes, state has {len(dst)}"
            )
        pos = 0
        for i, c in enumerate(entry.chunks):
            self._queued.append(_Chunk(entry, i, dst[pos : pos + c.length]))
            pos += c.length

    def submit(self, pending: list[Future[None]]) -> None:
        queued, self._queued = self._queued, []
        if self.ranges is None or self.range_bytes <= 0:
            pending.extend(self.pool.submit(self._one, c) for c in queued)
            return
        pending.extend(self.pool.submit(self._run, run) for run in self._runs(queued))

    def _runs(self, chunks: list[_Chunk]) -> list[_Run]:
        by_pack: dict[str, list[_Chunk]] = {}
        for c in chunks:
            by_pack.setdefault(c.entry.chunks[c.index].pack, []).append(c)
        runs: list[_Run] = []
        for pack, group in by_pack.items():
            group.sort(key=lambda c: c.offset)
            run = _Run(pack)
            for c in group:
                if run.chunks and (
                    c.offset < run.end
                    or c.offset - run.end > _MAX_GAP
                    or c.end - run.chunks[0].offset > self.range_bytes
                ):
                    runs.append(run)
                    run = _Run(pack)
                run.chunks.append(c)
            runs.append(run)
        # the largest first: the pool's last reads are small, no thread waits on a long tail
        runs.sort(key=lambda r: r.chunks[0].offset - r.end)
        return runs

    def _one(self, c: _Chunk) -> None:
        problem = read_chunk(self.storage, c.entry, c.index, c.view)
        if problem is not None:
            raise CheckpointCorruptError(problem, [problem])

    def _run(self, run: _Run) -> None:
        assert self.ranges is not None
        views: list[memoryview] = []
        owners: list[int] = []  # the chunk each view fills; -1: a gap's scratch bytes
        at = run.chunks[0].offset
        for k, c in enumerate(run.chunks):
            if c.offset > at:
                views.append(memoryview(bytearray(c.offset - at)))
                owners.append(-1)
            views.append(c.view)
            owners.append(k)
            at = c.end
        hashers: list[Any] = [new_hasher() for _ in run.chunks]
        landed = [0] * len(run.chunks)

        def on_piece(i: int, piece: memoryview) -> None:
            k = owners[i]
            if k >= 0:
                hashers[k].update(piece)
                landed[k] += len(piece)

        try:
            self.ranges(run.pack, run.chunks[0].offset, views, on_piece)
        except (OSError, EOFError, CheckpointFormatError) as err:
            k = next((k for k, c in enumerate(run.chunks) if landed[k] < len(c.view)), 0)
            why = err.strerror if isinstance(err, OSError) and err.strerror else err
            problem = f"{run.pack}: chunk at offset {run.chunks[k].offset} of tensor " + (
                f"{run.chunks[k].entry.path!r} unreadable ({why})"
            )
            raise CheckpointCorruptError(problem, [problem]) from err
        for k, c in enumerate(run.chunks):
            if hashers[k].hexdigest() != c.entry.chunks[c.index].hash:
                problem = (
                    f"{run.pack}: chunk at offset {c.offset} of tensor {c.entry.path!r} "
                    "fails its checksum"
                )
                raise CheckpointCorruptError(problem, [problem])
