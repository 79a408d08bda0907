"""`stalwart ckpt gc` and the persister's GC never delete outside the checkpoint root:
a linked `step_*`, `data/` or pack is reported and left alone, and the counts are true."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stalwart.checkpoint import RetentionPolicy, collect_garbage, committed_steps, publish_step
from stalwart.checkpoint._writer import write_rank
from stalwart.checkpoint.storage import LocalStorage
from stalwart.cli.main import main


def _save(storage: LocalStorage, step: int) -> None:
    data = memoryview(bytearray([step % 256]) * 32)
    layout = [{"id": 0, "path": ".w", "dtype": "uint8", "shape": [32], "nbytes": 32, "offset": 0}]
    tree = {"t": "tensor", "id": 0}
    write_rank(
        storage, step=step, rank=0, world_size=1, tree=tree, layout=layout, data=data, known={}
    )
    publish_step(storage, step, 1)


def _victim(tmp_path: Path, name: str) -> Path:
    victim = tmp_path / name
    victim.mkdir()
    for f in ("precious.txt", "000000000001-r00000-aaaaaaaa.pack", "MANIFEST.json"):
        (victim / f).write_text("keep me")
    return victim


def test_linked_step_dir_is_skipped_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    storage = LocalStorage(str(root), direct_io=False)
    for step in (2, 3, 4, 5):
        _save(storage, step)
    victim = _victim(tmp_path, "victim")
    os.symlink(victim, root / "step_000000000001")  # an old, "uncommitted" step
    assert main(["ckpt", "gc", str(root), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in victim.iterdir()) == sorted(
        ["precious.txt", "000000000001-r00000-aaaaaaaa.pack", "MANIFEST.json"]
    )
    assert "deleted 3 checkpoint(s) [2, 3, 4]" in out
    assert "step_000000000001: a link" in out
    assert (root / "step_000000000001").is_symlink()
    assert committed_steps(storage) == [5]


def test_linked_data_dir_and_pack_are_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    storage = LocalStorage(str(root), direct_io=False)
    for step in (2, 3):
        _save(storage, step)
    outside = tmp_path / "outside.pack"
    outside.write_text("keep me")
    os.symlink(outside, root / "data" / "000000000001-r00000-bbbbbbbb.pack")
    gc = collect_garbage(storage, RetentionPolicy(keep_last=1))
    assert outside.read_text() == "keep me"
    assert any("a link, not a pack file" in s for s in gc.skipped)
    assert gc.deleted_steps == [2] and len(gc.deleted_packs) == 0  # step 2's pack: 2 newest
    # now data/ itself is a link to a directory full of pack-named files
    real = root / "data"
    moved = tmp_path / "real-data"
    os.rename(real, moved)
    victim = _victim(tmp_path, "victim-data")
    os.symlink(victim, real)
    gc = collect_garbage(storage, RetentionPolicy(keep_last=1))
    assert len(list(victim.iterdir())) == 3
    assert any(s.startswith("data: a link") for s in gc.skipped) and gc.deleted_packs == []
