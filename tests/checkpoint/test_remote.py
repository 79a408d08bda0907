"""fsspec storage end to end (in-process: fsspec's memory filesystem is per process).

On an object store there is no rename: the manifest, written last with its own
checksum, is the commit marker. A step whose manifest was never written is invisible."""

from __future__ import annotations

import mmap
import uuid
from collections.abc import Iterator

import pytest
import torch

from stalwart.checkpoint import committed_steps, restore_state, verify_step
from stalwart.checkpoint._tree import flatten
from stalwart.checkpoint._writer import publish_step, write_rank
from stalwart.checkpoint.storage import FsspecStorage


@pytest.fixture
def storage() -> Iterator[FsspecStorage]:
    st = FsspecStorage(f"memory://ck-{uuid.uuid4().hex}")
    yield st
    if st.fs.exists(st.root):
        st.fs.rm(st.root, recursive=True)


def _save(storage: FsspecStorage, step: int, value: torch.Tensor, commit: bool) -> None:
    tree, leaves = flatten({"w": value})
    buf = mmap.mmap(-1, 4096 * 4)
    t = leaves[0].tensor
    raw = t.numpy().tobytes()
    buf[: len(raw)] = raw
    layout = [
        {
            "id": 0,
            "path": ".w",
            "dtype": "float32",
            "shape": list(t.shape),
            "nbytes": len(raw),
            "offset": 0,
            "shard": None,
        }
    ]
    with memoryview(buf) as data:
        write_rank(
            storage,
            step=step,
            rank=0,
            world_size=1,
            tree=tree,
            layout=layout,
            data=data,
            known={},
            chunk_bytes=1024,
        )
    if commit:
        publish_step(storage, step, 1)


def test_manifest_is_the_commit_marker(storage: FsspecStorage) -> None:
    _save(storage, 1, torch.arange(1000, dtype=torch.float32), commit=True)
    _save(storage, 2, torch.zeros(1000), commit=False)  # crashed before its manifest
    assert committed_steps(storage) == [1]
    assert verify_step(storage, 1).ok
    target = {"w": torch.empty(1000)}
    assert restore_state(storage, target).step == 1
    assert torch.equal(target["w"], torch.arange(1000, dtype=torch.float32))
