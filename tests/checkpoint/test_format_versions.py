"""Format versions: stalwart writes version 2 (the one that may hold ``copy_of``
entries) and still reads version 1, with or without copies; anything else is refused
with the fix in the message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _models import assert_same, make_state, params, train_step

from stalwart.checkpoint import CheckpointConfig, CheckpointManager, restore_state
from stalwart.checkpoint.format import (
    FORMAT_VERSION,
    ChunkRef,
    IndexRef,
    Manifest,
    RankIndex,
    TensorEntry,
    checksum,
    index_path,
    manifest_path,
)
from stalwart.checkpoint.storage import LocalStorage
from stalwart.errors import CheckpointFormatError

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


_PACK = "data/000000000005-r00000-abcd.pack"


def _copy_index(version: int) -> RankIndex:
    copy = TensorEntry(0, "w", "float32", [2], 8, [], {"global_shape": [4], "offsets": [2]}, 0)
    plain = TensorEntry(1, "b", "float32", [2], 8, [ChunkRef("0" * 32, _PACK, 0, 8)])
    tree = {"t": "list", "items": [{"t": "tensor", "id": 0}, {"t": "tensor", "id": 1}]}
    return RankIndex(5, 1, 2, tree, [copy, plain], version=version)


def _manifest(version: int) -> Manifest:
    ref = IndexRef(0, index_path(7, 0), "ab" * 16, 10)
    return Manifest(7, 1, [ref], [], 0, 0, 1.0, version=version)


def test_new_files_are_version_2() -> None:
    assert FORMAT_VERSION == 2
    assert json.loads(_manifest(FORMAT_VERSION).encode())["version"] == 2
    assert json.loads(RankIndex(1, 0, 1, None, []).encode())["version"] == 2


@pytest.mark.parametrize("version", [1, 2])
def test_both_versions_decode_with_copies(version: int) -> None:
    idx = RankIndex.decode(_copy_index(version).encode(), "idx")
    assert idx.version == version  # kept, so a re-encode is byte-for-byte the file read
    assert idx.tensors[0].copy_of == 0 and idx.tensors[1].copy_of is None
    m = Manifest.decode(_manifest(version).encode(), "m")  # its checksum covers version
    assert m.version == version and m == _manifest(version)


@pytest.mark.parametrize("version", [0, 3, "2", True, None])
def test_other_versions_are_refused_with_the_fix(version: object) -> None:
    doc = json.loads(_copy_index(2).encode())
    doc["version"] = version
    with pytest.raises(CheckpointFormatError, match=r"reads versions 1, 2\).*upgrade stalwart"):
        RankIndex.decode(json.dumps(doc).encode(), "idx")


def test_a_version_1_checkpoint_restores(tmp_path: Path, shm_namespace: str) -> None:
    """A root written by a stalwart of version 1 (rewritten so here: both files at
    version 1, re-checksummed) restores to the same parameters."""
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(CheckpointConfig(str(root), namespace=shm_namespace))
    try:
        state = make_state()
        mgr.save(state, 3)
        want = params(state)
    finally:
        mgr.close()
    idoc = json.loads((root / index_path(3, 0)).read_bytes())
    assert idoc["version"] == 2
    idoc["version"] = 1
    raw = json.dumps(idoc).encode()
    (root / index_path(3, 0)).write_bytes(raw)
    mdoc = json.loads((root / manifest_path(3)).read_bytes())
    mdoc["version"] = 1
    mdoc["indexes"][0].update(checksum=checksum(raw), nbytes=len(raw))
    del mdoc["checksum"]
    canon = json.dumps(mdoc, sort_keys=True, separators=(",", ":"))
    mdoc["checksum"] = checksum(canon.encode())
    (root / manifest_path(3)).write_text(json.dumps(mdoc))

    fresh = make_state(seed=1)
    train_step(fresh)
    result = restore_state(LocalStorage(str(root)), fresh)
    assert result.step == 3 and not result.skipped
    got = params(fresh)
    assert_same(got, want)
