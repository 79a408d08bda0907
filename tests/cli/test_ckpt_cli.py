"""`stalwart ckpt ...`: output, exit codes, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import CheckpointConfig, CheckpointManager
from stalwart.cli.main import main

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


@pytest.fixture
def ckpt_dir(tmp_path: Path, shm_namespace: str) -> Path:
    root = tmp_path / "ck"
    model = torch.nn.Linear(8, 8)
    mgr = CheckpointManager(CheckpointConfig(str(root), namespace=shm_namespace))
    try:
        mgr.save({"model": model, "meta": {"epoch": 1}}, 10)
        with torch.no_grad():
            model.weight.add_(1)
        mgr.save({"model": model, "meta": {"epoch": 1}}, 20)
    finally:
        mgr.close()
    return root


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_ls_json(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "ckpt", "ls", str(ckpt_dir), "--json")
    doc = json.loads(out)
    assert rc == 0 and [c["step"] for c in doc["checkpoints"]] == [10, 20]
    rc, out, _ = _run(capsys, "ckpt", "ls", str(ckpt_dir))
    assert "20" in out.splitlines()[-1]


def test_verify_ok_and_bad(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "ckpt", "verify", str(ckpt_dir), "--all", "--json")
    assert rc == 0 and json.loads(out)["ok"] is True
    pack = sorted((ckpt_dir / "data").iterdir())[-1]
    raw = bytearray(pack.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))
    rc, out, _ = _run(capsys, "ckpt", "verify", str(ckpt_dir))
    assert rc == 1 and pack.name in out and "checksum" in out


def test_inspect_lists_tensors(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "ckpt", "inspect", str(ckpt_dir), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["step"] == 20
    assert {t["path"] for t in doc["tensors"]} == {".model.weight", ".model.bias"}


def test_gc(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "ckpt", "gc", str(ckpt_dir), "--keep-last", "1")
    assert rc == 0 and "deleted 1 checkpoint(s) [10]" in out


def _one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc, _, err = _run(capsys, *argv)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stalwart: error: "), err
    return lines[0]


def test_bad_input_gets_one_line(
    ckpt_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "no such directory" in _one_line_error(capsys, "ckpt", "ls", str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no committed checkpoint" in _one_line_error(capsys, "ckpt", "verify", str(empty))
    assert "not committed" in _one_line_error(
        capsys, "ckpt", "verify", str(ckpt_dir), "--step", "5"
    )
    manifest = ckpt_dir / "step_000000000020" / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    doc["version"] = 42
    manifest.write_text(json.dumps(doc))
    assert "version 42 is not supported" in _one_line_error(
        capsys, "ckpt", "inspect", str(ckpt_dir)
    )
    manifest.write_bytes(manifest.read_bytes()[:20])
    assert "not valid JSON" in _one_line_error(capsys, "ckpt", "inspect", str(ckpt_dir))
    rc, out, _ = _run(capsys, "ckpt", "verify", str(ckpt_dir))
    assert rc == 1 and "not valid JSON" in out


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("loop", "Too many levels of symbolic links"),
        ("long", "File name too long"),
        ("http://127.0.0.1:9/ckpt", "cannot read the checkpoint root"),
    ],
)
@pytest.mark.parametrize("action", ["ls", "verify", "inspect", "gc"])
def test_an_unreachable_root_gets_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str, where: str, why: str
) -> None:
    """issue 27: a symlink loop, a 5,000-character path and an http:// root nothing
    listens at (port 9, discard: refused on loopback) each end in one line naming it."""
    if where == "loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        where = str(tmp_path / "a")
    elif where == "long":
        where = str(tmp_path / ("x" * 5000))
    line = _one_line_error(capsys, "ckpt", action, where)
    assert why in line and len(line) < 600
