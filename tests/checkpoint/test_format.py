from __future__ import annotations

import json

import pytest

from stalwart.checkpoint.format import ChunkRef, IndexRef, Manifest, RankIndex, TensorEntry
from stalwart.errors import CheckpointFormatError

_PACK = "data/000000000003-r00001-abcd1234.pack"


def _manifest() -> Manifest:
    return Manifest(
        step=7,
        world_size=1,
        indexes=[IndexRef(0, "step_000000000007/rank_00000.json", "ab" * 16, 10)],
        packs=["data/000000000007-r00000-abcd1234.pack"],
        total_bytes=100,
        new_bytes=50,
        created_unix=1.0,
    )


def test_manifest_round_trip() -> None:
    m = _manifest()
    assert Manifest.decode(m.encode(), "m") == m


def test_manifest_edit_is_detected() -> None:
    raw = _manifest().encode().replace(b'"total_bytes": 100', b'"total_bytes": 101')
    with pytest.raises(CheckpointFormatError, match="checksum mismatch"):
        Manifest.decode(raw, "m")


def test_truncated_and_unknown_version() -> None:
    raw = _manifest().encode()
    with pytest.raises(CheckpointFormatError, match="not valid JSON"):
        Manifest.decode(raw[: len(raw) // 2], "m")
    doc = json.loads(raw)
    doc["version"] = 99
    with pytest.raises(CheckpointFormatError, match="version 99 is not supported"):
        Manifest.decode(json.dumps(doc).encode(), "m")


def test_rank_index_round_trip() -> None:
    idx = RankIndex(
        3,
        1,
        2,
        {"t": "tensor", "id": 0},
        [TensorEntry(0, ".w", "float32", [2], 8, [ChunkRef("cd" * 16, _PACK, 0, 8)])],
    )
    again = RankIndex.decode(idx.encode(), "i")
    assert again.tensors[0].path == ".w" and again.world_size == 2
