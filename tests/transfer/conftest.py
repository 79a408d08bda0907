"""Fixtures: a job token, unique source/destination slot namespaces, a running receiver."""

from __future__ import annotations

import os
import secrets
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from stalwart.checkpoint.slots import SlotFiles, SlotMeta
from stalwart.contract.shm_names import slot_dir
from stalwart.transfer import ReceiverConfig, SlotReceiver

SHM = "/dev/shm"


@dataclass
class Spaces:
    src: str  # namespace of the sending side's slots
    dst: str  # namespace the receiver stores under

    @property
    def src_dir(self) -> str:
        return slot_dir(SHM, self.src)

    @property
    def dst_dir(self) -> str:
        return slot_dir(SHM, self.dst)


@pytest.fixture
def token() -> bytes:
    return secrets.token_hex(32).encode()


@pytest.fixture
def spaces() -> Iterator[Spaces]:
    tag = uuid.uuid4().hex[:10]
    sp = Spaces(f"test-xsrc-{tag}", f"test-xdst-{tag}")
    os.makedirs(sp.src_dir, mode=0o700)
    yield sp
    for d in (sp.src_dir, sp.dst_dir):
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def receiver(token: bytes) -> Iterator[SlotReceiver]:
    with SlotReceiver(token, ReceiverConfig(shm_dir=SHM, io_timeout_s=10.0)) as r:
        yield r


def write_slot(directory: str, index: int, seq: int, data: bytes, step: int = 0) -> SlotMeta:
    """A complete slot holding ``data`` as one uint8 tensor, written as the Snapshotter
    does (meta last, by rename)."""
    slot = SlotFiles(directory, index)
    slot.invalidate()
    mm = slot.map_writable(len(data))
    mm[: len(data)] = data
    meta = SlotMeta(
        seq=seq,
        step=step,
        tree={"t": "dict", "items": [["x", {"t": "tensor", "id": 0}]]},
        layout=[
            {
                "id": 0,
                "path": "x",
                "dtype": "uint8",
                "shape": [len(data)],
                "nbytes": len(data),
                "offset": 0,
                "shard": None,
                "ndarray": False,
            }
        ],
        data_size=len(data),
    )
    slot.publish(meta)
    slot.close()
    return meta


def read_slot(directory: str, index: int) -> tuple[SlotMeta | None, bytes]:
    slot = SlotFiles(directory, index)
    meta = slot.read_meta()
    if meta is None:
        return None, b""
    with open(slot.data_path, "rb") as f:
        return meta, f.read(meta.data_size)
