"""One conformance suite that every storage backend must pass."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _s3_server import CREDENTIALS, new_bucket, server_of

from stalwart.checkpoint.storage import (
    FsspecStorage,
    LocalStorage,
    S3Config,
    S3Storage,
    Storage,
    open_storage,
)


@pytest.fixture(params=["local", "fsspec-memory", "fsspec-file", "s3"])
def storage(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Storage]:
    if request.param == "s3":  # moto's real S3 server on loopback (tests/_tiers.py: e2e)
        server = server_of(request)
        for k, v in CREDENTIALS.items():
            monkeypatch.setenv(k, v)
        url = f"s3://{new_bucket(server.url)}/run/ck"
        yield S3Storage(url, S3Config(endpoint_url=server.url))
    elif request.param == "local":
        yield LocalStorage(str(tmp_path / "ck"))
    elif request.param == "fsspec-memory":
        url = f"memory://stalwart-{uuid.uuid4().hex}"
        st = FsspecStorage(url)
        yield st
        if st.fs.exists(st.root):
            st.fs.rm(st.root, recursive=True)
    else:
        yield FsspecStorage(f"local://{tmp_path}/ck")


def test_atomic_write_and_read(storage: Storage) -> None:
    storage.write_atomic("a/b.json", b"hello")
    assert storage.read("a/b.json") == b"hello"
    assert storage.exists("a/b.json") and not storage.exists("a/c.json")
    assert storage.listdir("a") == ["b.json"]
    assert storage.size("a/b.json") == 5


def test_stream_invisible_until_commit(storage: Storage) -> None:
    s = storage.open_stream("data/x.pack")
    s.write(b"abc")
    s.write(memoryview(b"def"))
    assert not storage.exists("data/x.pack")
    s.commit()
    buf = bytearray(4)
    storage.read_into("data/x.pack", 1, memoryview(buf))
    assert bytes(buf) == b"bcde"


def test_read_pieces_cover_the_buffer_in_order(storage: Storage) -> None:
    """The checksum of a chunk is computed on the pieces a read hands over: they must be
    exactly the bytes read, in order, whatever piece size the backend uses."""
    data = bytes(range(256)) * 9000  # 2.3 MB: several pieces of the local backend
    storage.write_atomic("big", data)
    buf = bytearray(len(data) - 7)
    seen: list[bytes] = []
    storage.read_into("big", 7, memoryview(buf), lambda piece: seen.append(bytes(piece)))
    assert b"".join(seen) == bytes(buf) == data[7:]


def test_abort_leaves_nothing(storage: Storage) -> None:
    s = storage.open_stream("data/y.pack")
    s.write(b"abc")
    s.abort()
    assert "y.pack" not in storage.listdir("data")


def test_short_read_and_missing(storage: Storage) -> None:
    storage.write_atomic("f", b"12")
    with pytest.raises(EOFError):
        storage.read_into("f", 0, memoryview(bytearray(5)))
    with pytest.raises(FileNotFoundError):
        storage.read_into("nope", 0, memoryview(bytearray(1)))
    assert storage.listdir("no-such-dir") == []


def test_delete_is_idempotent(storage: Storage) -> None:
    storage.write_atomic("d/f", b"x")
    storage.delete("d/f")
    storage.delete("d/f")
    storage.delete_dir("d")
    assert not storage.exists("d/f")


def test_open_storage_picks_backend(tmp_path: Path) -> None:
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    assert isinstance(open_storage("memory://x"), FsspecStorage)
    assert isinstance(open_storage("s3://bucket/a/b"), S3Storage)
