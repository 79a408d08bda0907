"""The on-storage checkpoint format (version 1), documented in docs/checkpoint-format.md.

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

from stalwart.errors import CheckpointFormatError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "QUARANTINE_NAME",
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

FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
QUARANTINE_NAME = "QUARANTINED.json"  # replaces the manifest of a step found damaged
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
    def from_json(v: Any) -> ChunkRef:
        h, p, o, n = v
        return ChunkRef(str(h), str(p), int(o), int(n))


@dataclass
class TensorEntry:
    """One tensor of a rank's state. ``shard`` describes a DTensor's local piece:
    ``{"global_shape": [...], "offsets": [...]}``; None for a whole (replicated) tensor."""

    id: int
    path: str
    dtype: str
    shape: list[int]
    nbytes: int
    chunks: list[ChunkRef]
    shard: dict[str, list[int]] | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = [c.to_json() for c in self.chunks]
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> TensorEntry:
        return TensorEntry(
            id=int(d["id"]),
            path=str(d["path"]),
            dtype=str(d["dtype"]),
            shape=[int(x) for x in d["shape"]],
            nbytes=int(d["nbytes"]),
            chunks=[ChunkRef.from_json(c) for c in d["chunks"]],
            shard=d.get("shard"),
        )


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
            return RankIndex(
                step=int(d["step"]),
                rank=int(d["rank"]),
                world_size=int(d["world_size"]),
                tree=d["tree"],
                tensors=[TensorEntry.from_json(t) for t in d["tensors"]],
                new_bytes=int(d.get("new_bytes", 0)),
                version=int(d["version"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointFormatError(
                f"{where}: malformed rank index ({err!r}); the file is damaged: "
                "use an earlier checkpoint"
            ) from err


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
            m = Manifest(
                step=int(d["step"]),
                world_size=int(d["world_size"]),
                generation=int(d["generation"]),
                replicated=bool(d["replicated"]),
                indexes=[IndexRef(**i) for i in d["indexes"]],
                packs=[str(p) for p in d["packs"]],
                total_bytes=int(d["total_bytes"]),
                new_bytes=int(d["new_bytes"]),
                created_unix=float(d["created_unix"]),
                meta=dict(d["meta"]),
                version=int(d["version"]),
            )
            stored = str(d["checksum"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointFormatError(
                f"{where}: malformed manifest ({err!r}); the file is damaged: "
                "use an earlier checkpoint"
            ) from err
        canon = json.dumps(m._body(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        if checksum(canon.encode()) != stored:
            raise CheckpointFormatError(
                f"{where}: manifest checksum mismatch (the file was modified or damaged); "
                "use an earlier checkpoint"
            )
        return m


def _load_json(data: bytes, where: str, fmt: str) -> dict[str, Any]:
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointFormatError(
            f"{where}: not valid JSON ({err.__class__.__name__}: truncated or damaged); "
            "use an earlier checkpoint"
        ) from err
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise CheckpointFormatError(f"{where}: not a {fmt} file (wrong 'format' field)")
    version = d.get("version")
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{where}: format version {version!r} is not supported by this stalwart "
            f"(reads version {FORMAT_VERSION}); upgrade stalwart to read it"
        )
    return d
