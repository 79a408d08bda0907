"""The job token file: 0600, never overwritten, refused when others can read it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stalwart.coordinator import StoreClient, TokenFileError, create_token_file, read_token_file


def test_create_is_private_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "token"
    old_umask = os.umask(0)  # even a permissive umask must not widen the mode
    try:
        token = create_token_file(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(token) == 64
    assert read_token_file(path) == token
    assert create_token_file(tmp_path / "other") != token


def test_create_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "token"
    token = create_token_file(path)
    with pytest.raises(TokenFileError, match="already exists"):
        create_token_file(path)
    assert read_token_file(path) == token


def test_read_refuses_group_or_world_readable(tmp_path: Path) -> None:
    path = tmp_path / "token"
    create_token_file(path)
    path.chmod(0o644)
    with pytest.raises(TokenFileError, match="chmod 600"):
        read_token_file(path)


def test_read_missing_and_short(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="not found"):
        read_token_file(tmp_path / "absent")
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    short.chmod(0o600)
    with pytest.raises(TokenFileError, match="fewer than"):
        read_token_file(short)


def test_client_from_token_file(tmp_path: Path) -> None:
    from stalwart.coordinator import StoreServer

    path = tmp_path / "token"
    token = create_token_file(path)
    with (
        StoreServer(token) as server,
        StoreClient.from_token_file("127.0.0.1", server.port, path) as client,
    ):
        assert client.put("k", b"v") == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_read_refuses_a_file_of_another_user(tmp_path: Path) -> None:
    path = tmp_path / "token"
    create_token_file(path)
    os.chown(path, os.geteuid() + 4242, -1)
    with pytest.raises(TokenFileError, match="belongs to uid"):
        read_token_file(path)


def test_read_refuses_group_writable_and_non_regular(tmp_path: Path) -> None:
    path = tmp_path / "token"
    create_token_file(path)
    path.chmod(0o620)
    with pytest.raises(TokenFileError, match="chmod 600"):
        read_token_file(path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(TokenFileError, match="not a regular file"):
        read_token_file(fifo)
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(TokenFileError, match=r"not a regular file|cannot read"):
        read_token_file(tmp_path / "dir")
