"""Find, list and verify committed checkpoints (no torch needed).

A step is *committed* when its manifest exists; it is *valid* when the manifest, every
rank index and every chunk it references check out. Restore and ``stalwart ckpt
verify`` use the same checks, so what verify accepts is what restore can load.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from stalwart.checkpoint._layout import layout_problems
from stalwart.checkpoint.format import (
    Manifest,
    RankIndex,
    TensorEntry,
    checksum,
    manifest_path,
    new_hasher,
    parse_step_dir,
)
from stalwart.checkpoint.storage import Storage
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
)

__all__ = [
    "VerifyReport",
    "committed_steps",
    "iter_chunks",
    "load_index",
    "load_manifest",
    "read_chunk",
    "require_checkpoint_root",
    "verify_step",
]


def committed_steps(storage: Storage) -> list[int]:
    """Steps with a manifest file, oldest first (validity not checked)."""
    steps = []
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is not None and storage.exists(manifest_path(step)):
            steps.append(step)
    return sorted(steps)


def require_checkpoint_root(storage: Storage) -> list[int]:
    """Committed steps, or a clear error when ``storage`` is not a checkpoint directory."""
    names = storage.listdir("")
    if not names and not storage.exists(""):
        raise CheckpointNotFoundError(
            f"{storage.url}: no such directory; pass the checkpoint directory of a run"
        )
    steps = committed_steps(storage)
    if not steps:
        raise CheckpointNotFoundError(
            f"{storage.url}: no committed checkpoint here (no step_*/MANIFEST.json); "
            "pass the checkpoint directory of a run that saved at least once"
        )
    return steps


def load_manifest(storage: Storage, step: int) -> Manifest:
    path = manifest_path(step)
    try:
        raw = storage.read(path)
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"step {step} has no manifest ({path})") from err
    except OSError as err:
        raise CheckpointFormatError(f"{path}: unreadable ({err.strerror or err})") from err
    m = Manifest.decode(raw, f"{storage.url}/{path}")
    if m.step != step:
        raise CheckpointFormatError(f"{path}: manifest of step {m.step} in step {step}'s place")
    return m


def load_index(storage: Storage, manifest: Manifest, rank: int) -> RankIndex:
    """The rank's index, checked against the checksum the manifest recorded for it, and
    against the manifest itself (same step, rank, world size; only packs it lists)."""
    if not 0 <= rank < len(manifest.indexes):
        raise CheckpointFormatError(
            f"step {manifest.step} has rank indexes 0..{len(manifest.indexes) - 1}, not {rank}"
        )
    ref = manifest.indexes[rank]
    try:
        raw = storage.read(ref.path)
    except FileNotFoundError as err:
        raise CheckpointCorruptError(
            f"{ref.path} is missing (step {manifest.step}, rank {rank})",
            [f"{ref.path}: missing"],
        ) from err
    except OSError as err:
        raise CheckpointCorruptError(
            f"{ref.path} is unreadable ({err.strerror or err}; step {manifest.step})",
            [f"{ref.path}: unreadable ({err.strerror or err})"],
        ) from err
    if checksum(raw) != ref.checksum:
        raise CheckpointCorruptError(
            f"{ref.path} fails its checksum (step {manifest.step}, rank {rank})",
            [f"{ref.path}: checksum mismatch"],
        )
    index = RankIndex.decode(raw, ref.path)
    if (index.step, index.rank, index.world_size) != (manifest.step, rank, manifest.world_size):
        raise CheckpointFormatError(
            f"{ref.path}: index of step {index.step} rank {index.rank}/{index.world_size} "
            f"under step {manifest.step} rank {rank}/{manifest.world_size}; damaged"
        )
    foreign = index.packs - set(manifest.packs)
    if foreign:
        raise CheckpointFormatError(
            f"{ref.path}: references pack {sorted(foreign)[0]} that the manifest does not "
            "list; the checkpoint is not self-contained: use an earlier one"
        )
    return index


def iter_chunks(index: RankIndex) -> Iterator[tuple[TensorEntry, int]]:
    for t in index.tensors:
        for i in range(len(t.chunks)):
            yield t, i


def read_chunk(storage: Storage, t: TensorEntry, i: int, buf: memoryview) -> str | None:
    """Read chunk ``i`` of tensor ``t`` into ``buf`` and check its hash; returns what is
    wrong (file, offset, tensor) or None. Used by verify and by restore, so both judge
    a chunk the same way."""
    c = t.chunks[i]
    hasher = new_hasher()
    try:
        storage.read_into(c.pack, c.offset, buf, hasher.update)
    except (OSError, EOFError, CheckpointFormatError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else err
        return f"{c.pack}: chunk at offset {c.offset} of tensor {t.path!r} unreadable ({why})"
    if hasher.hexdigest() != c.hash:
        return f"{c.pack}: chunk at offset {c.offset} of tensor {t.path!r} fails its checksum"
    return None


@dataclass
class VerifyReport:
    step: int
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0

    def add(self, problem: str) -> None:
        self.ok = False
        self.problems.append(problem)


def verify_step(
    storage: Storage, step: int, *, deep: bool = True, threads: int = 4
) -> VerifyReport:
    """Check the manifest, every index and (``deep``) every chunk of ``step``; collects
    every problem (file and tensor) instead of stopping at the first."""
    report = VerifyReport(step)
    try:
        manifest = load_manifest(storage, step)
    except (CheckpointFormatError, CheckpointNotFoundError) as err:
        report.add(str(err))
        return report
    try:
        present = set(storage.listdir("data"))
    except CheckpointFormatError as err:  # data/ is a link: nothing in it is read
        report.add(str(err))
        return report
    for pack in manifest.packs:
        if pack.rsplit("/", 1)[-1] not in present:
            report.add(f"{pack}: missing pack file")
    indexes: list[RankIndex] = []
    for rank in range(len(manifest.indexes)):
        try:
            indexes.append(load_index(storage, manifest, rank))
        except (CheckpointCorruptError, CheckpointFormatError) as err:
            report.add(str(err))
    if len(indexes) == len(manifest.indexes):
        for issue in layout_problems(indexes):  # copies resolve; boxes tile exactly
            report.add(issue)
    if not deep:
        return report
    # a reference is checked once per (pack, offset, length, hash): keyed by place alone, a
    # second claim on the same bytes with another length or hash went unchecked and verify
    # said ok of a step that export then refused
    seen: set[tuple[str, int, int, str]] = set()
    work: list[tuple[TensorEntry, int]] = []
    for index in indexes:
        for t, i in iter_chunks(index):
            c = t.chunks[i]
            if (key := (c.pack, c.offset, c.length, c.hash)) not in seen:
                seen.add(key)
                work.append((t, i))

    def check(item: tuple[TensorEntry, int]) -> str | None:
        t, i = item
        return read_chunk(storage, t, i, memoryview(bytearray(t.chunks[i].length)))

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for item, problem in zip(work, pool.map(check, work), strict=True):
            report.chunks_checked += 1
            report.bytes_checked += item[0].chunks[item[1]].length
            if problem is not None:
                report.add(problem)
    return report
