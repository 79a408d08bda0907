"""The on-storage checkpoint format (version 2), documented in docs/checkpoint-format.md.

This module imports no torch: the background persister and ``stalwart ckpt`` read and
write the format with the standard library and xxhash only.

Layout under a checkpoint root::

    data/<step>-r<rank>-<nonce>.pack     chunk bytes, append-only, shared by later steps
    step_<step>/rank_<rank>.json         per-rank index: tree + tensor table + chunk refs
    step_<step>/MANIFEST.json            written last: its presence commits the step

Every chunk is addressed by its xxh3-128 hash, which is also its checksum: a chunk whose
hash is already stored is referenced, not written again (incremental checkpoints).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from stalwart.checkpoint import _validate as v
from stalwart.errors import CheckpointFormatError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PENDING_PREFIX",
    "QUARANTINE_DIR",
    "QUARANTINE_NAME",
    "READ_VERSIONS",
    "ChunkRef",
    "IndexRef",
    "Manifest",
    "RankIndex",
    "TensorEntry",
    "checksum",
    "index_path",
    "manifest_path",
    "new_hasher",
    "pack_path",
    "parse_step_dir",
    "step_dir",
]

FORMAT_VERSION = 2
# Version 2 added ``TensorEntry.copy_of`` (HSDP persist dedupe): an entry without bytes.
# A reader of version 1 takes such an entry for a damaged one ("its chunks do not add
# up"), so files that may hold one say 2, and an old reader asks to be upgraded instead.
# Version 1 files are still read: they are version 2 files without copies (builds that
# wrote copies before the bump labelled them 1; those copies are read too).
READ_VERSIONS = (1, 2)
MANIFEST_NAME = "MANIFEST.json"
QUARANTINE_NAME = "QUARANTINED.json"  # replaces the manifest of a step found damaged
QUARANTINE_DIR = "quarantine"  # damaged steps are moved here, inside the root
PENDING_PREFIX = "MANIFEST.pending-g"  # a manifest awaiting its fenced commit record
_STEP_RE = re.compile(r"^step_(\d{12})$")


def checksum(data: bytes | bytearray | memoryview) -> str:
    """xxh3-128 of ``data`` as 32 hex digits (about 25 GB/s here; see docs for the choice)."""
    return xxhash.xxh3_128_hexdigest(data)


def new_hasher() -> Any:
    """A streaming form of :func:`checksum` (``update(piece)``, then ``hexdigest()``):
    the same digest, computed piece by piece as the bytes arrive."""
    return xxhash.xxh3_128()


def step_dir(step: int) -> str:
    return f"step_{step:012d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def manifest_path(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def index_path(step: int, rank: int) -> str:
    return f"{step_dir(step)}/rank_{rank:05d}.json"


def pack_path(step: int, rank: int, nonce: str) -> str:
    return f"data/{step:012d}-r{rank:05d}-{nonce}.pack"


def pack_step(name: str) -> int | None:
    """The step a pack file was written for (``data/<step>-r...``), or None if not a pack."""
    base = name.rsplit("/", 1)[-1]
    head = base.split("-", 1)[0]
    return int(head) if head.isdigit() and base.endswith(".pack") else None


@dataclass(frozen=True)
class ChunkRef:
    """``length`` bytes at ``offset`` of ``pack`` whose xxh3-128 is ``hash``."""

    hash: str
    pack: str
    offset: int
    length: int

    def to_json(self) -> list[Any]:
        return [self.hash, self.pack, self.offset, self.length]

    @staticmethod
    def from_json(raw: Any, where: str = "index") -> ChunkRef:
        if not isinstance(raw, list) or len(raw) != 4:
            raise CheckpointFormatError(f"{where}: a chunk is not [hash, pack, offset, length]")
        h, p, o, n = raw
        offset = v.want_int(o, where, "chunk offset", 0, v.MAX_FILE_BYTES)
        length = v.want_int(n, where, "chunk length", 1, v.MAX_CHUNK_BYTES)
        return ChunkRef(v.want_hash(h, where, "chunk hash"), v.want_pack(p, where), offset, length)


@dataclass
class TensorEntry:
    """One tensor of a rank's state. ``shard`` describes a DTensor's local piece:
    ``{"global_shape": [...], "offsets": [...]}``; None for a whole (replicated) tensor.
    ``copy_of``: the rank of the same step whose index holds this shard's bytes (an HSDP
    replica at replicate coordinate > 0 writes none of its shards' bytes: its coordinate-0
    peer has the same ones); ``chunks`` is then empty and ``shard`` set."""

    id: int
    path: str
    dtype: str
    shape: list[int]
    nbytes: int
    chunks: list[ChunkRef]
    shard: dict[str, list[int]] | None = None
    copy_of: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = [c.to_json() for c in self.chunks]
        if self.copy_of is None:
            del d["copy_of"]  # the field is new: indexes without copies are as before
        return d

    @staticmethod
    def from_json(raw: Any, where: str = "index") -> TensorEntry:
        d = v.want_dict(raw, where, "a tensor entry")
        try:
            tid, path, dtype = d["id"], d["path"], d["dtype"]
            shape, nbytes, chunks = d["shape"], d["nbytes"], d["chunks"]
        except KeyError as err:
            raise CheckpointFormatError(f"{where}: a tensor entry has no {err}") from err
        path = v.want_str(path, where, "tensor path")
        at = f"{where}: tensor {path[:80]!r}"
        if not isinstance(dtype, str) or dtype not in v.DTYPE_SIZES:
            raise CheckpointFormatError(f"{at}: unknown dtype {str(dtype)[:20]!r}; damaged")
        dims = v.want_shape(shape, at, "shape")
        size = v.want_int(nbytes, at, "nbytes", 0, v.MAX_TENSOR_BYTES)
        if v.numel(dims) * v.DTYPE_SIZES[dtype] != size:
            raise CheckpointFormatError(
                f"{at}: shape {dims[:8]} of {dtype} is not {size} bytes; the index is damaged"
            )
        refs = [ChunkRef.from_json(c, at) for c in v.want_list(chunks, at, "chunks")]
        shard = _shard(d.get("shard"), dims, at)
        copy_of = d.get("copy_of")
        if copy_of is not None:
            copy_of = v.want_int(copy_of, at, "copy_of", 0, v.MAX_RANKS - 1)
            if refs or shard is None:
                raise CheckpointFormatError(f"{at}: a copy entry has chunks or no shard; damaged")
        elif sum(c.length for c in refs) != size:
            raise CheckpointFormatError(f"{at}: its chunks do not add up to {size} bytes")
        return TensorEntry(
            id=v.want_int(tid, at, "id", 0, 1 << 40),
            path=path,
            dtype=dtype,
            shape=dims,
            nbytes=size,
            chunks=refs,
            shard=shard,
            copy_of=copy_of,
        )


def _shard(raw: Any, shape: list[int], where: str) -> dict[str, list[int]] | None:
    """A DTensor box: offsets + shape inside global_shape, as many dims as the shape."""
    if raw is None:
        return None
    d = v.want_dict(raw, where, "shard")
    glob = v.want_shape(d.get("global_shape"), where, "shard global_shape")
    offs = v.want_shape(d.get("offsets"), where, "shard offsets")
    if len(glob) != len(shape) or len(offs) != len(shape) or set(d) - {"global_shape", "offsets"}:
        raise CheckpointFormatError(f"{where}: shard box does not match the shape; damaged")
    if any(o + n > g for o, n, g in zip(offs, shape, glob, strict=True)):
        raise CheckpointFormatError(f"{where}: shard lies outside its global shape; damaged")
    if v.numel(glob) > v.MAX_TENSOR_BYTES:
        raise CheckpointFormatError(f"{where}: shard global shape too large; damaged")
    return {"global_shape": glob, "offsets": offs}


@dataclass
class RankIndex:
    step: int
    rank: int
    world_size: int
    tree: Any
    tensors: list[TensorEntry]
    new_bytes: int = 0
    version: int = FORMAT_VERSION

    @property
    def packs(self) -> set[str]:
        return {c.pack for t in self.tensors for c in t.chunks}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def encode(self) -> bytes:
        body = {
            "format": "stalwart.rank-index",
            "version": self.version,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "new_bytes": self.new_bytes,
            "tree": self.tree,
            "tensors": [t.to_json() for t in self.tensors],
        }
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()

    @staticmethod
    def decode(data: bytes, where: str) -> RankIndex:
        d = _load_json(data, where, "stalwart.rank-index")
        try:
            step, rank, world = d["step"], d["rank"], d["world_size"]
            tree, tensors = d["tree"], d["tensors"]
        except KeyError as err:
            raise CheckpointFormatError(
                f"{where}: malformed rank index (no {err}); the file is damaged: "
                "use an earlier checkpoint"
            ) from err
        world_size = v.want_int(world, where, "world_size", 1, v.MAX_RANKS)
        entries = [TensorEntry.from_json(t, where) for t in v.want_list(tensors, where, "tensors")]
        ids = {t.id for t in entries}
        if len(ids) != len(entries):
            raise CheckpointFormatError(f"{where}: two tensors share an id; damaged")
        if any(t.copy_of is not None and not 0 <= t.copy_of < world_size for t in entries):
            raise CheckpointFormatError(f"{where}: a copy entry names no rank of the step")
        v.check_tree(tree, ids, where)
        return RankIndex(
            step=v.want_int(step, where, "step", 0, v.MAX_STEP),
            rank=v.want_int(rank, where, "rank", 0, world_size - 1),
            world_size=world_size,
            tree=tree,
            tensors=entries,
            new_bytes=v.want_int(d.get("new_bytes", 0), where, "new_bytes", 0, v.MAX_FILE_BYTES),
            version=d["version"],
        )


@dataclass(frozen=True)
class IndexRef:
    rank: int
    path: str
    checksum: str
    nbytes: int


@dataclass
class Manifest:
    """The commit record of one step. ``checksum`` covers every other field."""

    step: int
    world_size: int
    indexes: list[IndexRef]
    packs: list[str]
    total_bytes: int
    new_bytes: int
    created_unix: float
    generation: int = 0
    replicated: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    def _body(self) -> dict[str, Any]:
        return {
            "format": "stalwart.manifest",
            "version": self.version,
            "step": self.step,
            "world_size": self.world_size,
            "generation": self.generation,
            "replicated": self.replicated,
            "indexes": [asdict(i) for i in self.indexes],
            "packs": sorted(self.packs),
            "total_bytes": self.total_bytes,
            "new_bytes": self.new_bytes,
            "created_unix": self.created_unix,
            "meta": self.meta,
        }

    def encode(self) -> bytes:
        body = self._body()
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
        body["checksum"] = checksum(canon.encode())
        return json.dumps(body, sort_keys=True, indent=1, allow_nan=False).encode()

    @staticmethod
    def decode(data: bytes, where: str) -> Manifest:
        d = _load_json(data, where, "stalwart.manifest")
        try:
            step = v.want_int(d["step"], where, "step", 0, v.MAX_STEP)
            world = v.want_int(d["world_size"], where, "world_size", 1, v.MAX_RANKS)
            raw_indexes = v.want_list(d["indexes"], where, "indexes", v.MAX_RANKS)
            packs = [v.want_pack(p, where) for p in v.want_list(d["packs"], where, "packs")]
            m = Manifest(
                step=step,
                world_size=world,
                generation=v.want_int(d["generation"], where, "generation", 0, v.MAX_GENERATION),
                replicated=v.want_bool(d["replicated"], where, "replicated"),
                indexes=[_index_ref(i, r, step, where) for r, i in enumerate(raw_indexes)],
                packs=packs,
                total_bytes=v.want_int(d["total_bytes"], where, "total_bytes", 0, 1 << 60),
                new_bytes=v.want_int(d["new_bytes"], where, "new_bytes", 0, 1 << 60),
                created_unix=v.want_float(d["created_unix"], where, "created_unix", 0, v.MAX_UNIX),
                meta=v.want_dict(d["meta"], where, "meta"),
                version=d["version"],
            )
            stored = v.want_hash(d["checksum"], where, "checksum")
        except KeyError as err:
            raise CheckpointFormatError(
                f"{where}: malformed manifest (no {err}); the file is damaged: "
                "use an earlier checkpoint"
            ) from err
        if len(m.indexes) != world:
            raise CheckpointFormatError(
                f"{where}: world_size {world} but {len(m.indexes)} rank index(es); "
                "the manifest is damaged: use an earlier checkpoint"
            )
        if len(set(packs)) != len(packs):
            raise CheckpointFormatError(f"{where}: a pack is listed twice; damaged")
        canon = json.dumps(m._body(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        if checksum(canon.encode()) != stored:
            raise CheckpointFormatError(
                f"{where}: manifest checksum mismatch (the file was modified or damaged); "
                "use an earlier checkpoint"
            )
        return m


def _index_ref(raw: Any, rank: int, step: int, where: str) -> IndexRef:
    """Entry ``rank`` of a manifest's index list: exactly that rank's index file."""
    d = v.want_dict(raw, where, f"indexes[{rank}]")
    if set(d) != {"rank", "path", "checksum", "nbytes"}:
        raise CheckpointFormatError(f"{where}: indexes[{rank}] has the wrong fields; damaged")
    v.want_int(d["rank"], where, f"indexes[{rank}].rank", rank, rank)
    if d["path"] != index_path(step, rank):
        raise CheckpointFormatError(
            f"{where}: indexes[{rank}].path {str(d['path'])[:80]!r} is not "
            f"{index_path(step, rank)}; the manifest is damaged or crafted"
        )
    return IndexRef(
        rank,
        d["path"],
        v.want_hash(d["checksum"], where, f"indexes[{rank}].checksum"),
        v.want_int(d["nbytes"], where, f"indexes[{rank}].nbytes", 0, v.MAX_INDEX_BYTES),
    )


def _load_json(data: bytes, where: str, fmt: str) -> dict[str, Any]:
    try:
        d = json.loads(data, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointFormatError(
            f"{where}: not valid JSON ({err.__class__.__name__}: truncated or damaged); "
            "use an earlier checkpoint"
        ) from err
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise CheckpointFormatError(f"{where}: not a {fmt} file (wrong 'format' field)")
    version = d.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise CheckpointFormatError(
            f"{where}: format version {version!r} is not supported by this stalwart "
            f"(reads versions {', '.join(map(str, READ_VERSIONS))}); upgrade stalwart to read it"
        )
    return d


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
