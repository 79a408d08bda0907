"""`stalwart ckpt` on a bucket URL without the library its backend needs: one line naming
the extra to install, exit 2, no traceback (s3:// is boto3's S3Storage: stalwart[s3];
other fsspec URLs need fsspec: stalwart[remote])."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stalwart.cli.main import main


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "s3://bucket/x"],
        ["verify", "s3://bucket/x"],
        ["inspect", "s3://bucket/x"],
        ["gc", "s3://bucket/x"],
        ["ls", "s3://bucket/x", "--s3-endpoint", "http://127.0.0.1:9"],
        ["export", "s3://bucket/x", "OUT"],
    ],
)
def test_s3_url_without_boto3(
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # `import boto3` raises ImportError
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    rc = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("stalwart: error: ") and "pip install 'stalwart[s3]'" in err


def test_fsspec_url_without_fsspec(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)
    rc = main(["ckpt", "ls", "gs://bucket/x"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1
    assert "pip install 'stalwart[remote]'" in err
