"""Crash consistency: a small run of bench/torture_checkpoint.py (SIGKILL the persisting
process at random instants, check the latest checkpoint after each kill), and proof that
its checker fails when the storage is really wrong."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from _load import scaled

from stalwart.checkpoint.catalog import committed_steps, load_manifest
from stalwart.checkpoint.format import manifest_path, pack_step
from stalwart.checkpoint.storage import open_storage

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


BENCH = Path(__file__).resolve().parents[2] / "bench" / "torture_checkpoint.py"


@pytest.fixture(scope="module")
def torture() -> ModuleType:
    """bench/ is not a package: load the script by path."""
    spec = importlib.util.spec_from_file_location("torture_checkpoint", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _small(torture: ModuleType, root: Path, **kw: Any) -> Any:
    """Smaller state than the full run: quicker steps, same structure (partial chunk,
    chunks changing at 4 rates, 2 ranks)."""
    return torture.TortureConfig(
        root=str(root), rank_bytes=(512 << 10) + 777, chunk_bytes=32 << 10, **kw
    )


def _flip_byte_in_newest_pack(root: str) -> str:
    """Flip one byte in a pack written for the newest committed step (every byte of such
    a pack belongs to that step's chunks). Returns the pack's path."""
    storage = open_storage(root)
    newest = committed_steps(storage)[-1]
    packs = [p for p in load_manifest(storage, newest).packs if pack_step(p) == newest]
    assert packs, f"step {newest} wrote no pack"
    path = os.path.join(root, packs[0])
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    return packs[0]


def test_small_torture_run_has_no_failures(
    torture: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _small(torture, tmp_path / "ckpt", instants=12, seed=11)
    made: list[str] = []  # the run's own temp dirs (another run beside it has its own)
    real_mkdtemp = tempfile.mkdtemp

    def recorded(*args: Any, **kw: Any) -> str:
        path = real_mkdtemp(*args, **kw)
        made.append(path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", recorded)
    summary = torture.run_torture(cfg)
    shm = [p for p in made if p.startswith("/dev/shm/")]
    assert shm, "the torture run made no /dev/shm directory: the check below checks nothing"
    assert not [p for p in shm if os.path.exists(p)]  # cleaned up
    assert summary.failures == 0, summary.failed
    assert summary.instants == 12
    assert summary.leaked_files == 0
    assert not summary.child_imported_torch
    assert summary.committed_steps_seen >= 3
    # every 10 instants include a self-kill inside a commit and one inside a GC
    assert summary.kills_by_phase["commit"] >= 1 and summary.kills_by_phase["gc"] >= 1
    assert sum(summary.kills_by_mode.values()) == 12


def test_run_counts_a_failure_when_a_byte_flips(torture: ModuleType, tmp_path: Path) -> None:
    flipped: list[str] = []

    def damage(root: str, instant: int) -> None:
        if instant == 2:
            flipped.append(_flip_byte_in_newest_pack(root))

    cfg = _small(torture, tmp_path / "ckpt", instants=2, seed=3, clean_steps=1)
    summary = torture.run_torture(cfg, before_check=damage)
    assert flipped
    failed = {f["instant"]: f["problems"] for f in summary.failed}
    assert 1 not in failed and 2 in failed, summary.failed
    text = " | ".join(failed[2])
    assert "fails its checksum" in text and flipped[0] in text
    assert "loaded step" in text  # restore of the latest fell back to an older step
    assert summary.failures >= 1


def test_checker_accepts_good_and_flags_flipped_byte(torture: ModuleType, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    cfg = _small(torture, tmp_path / "ckpt", seed=5)
    assert torture.save_steps(cfg, root, 3) == ""
    assert torture.check_storage(root, cfg, torture.Tracker()) == []
    _flip_byte_in_newest_pack(root)
    problems = torture.check_storage(root, cfg, torture.Tracker())
    assert any(p.startswith("verify step") and "checksum" in p for p in problems), problems


def test_checker_flags_a_vanished_step(torture: ModuleType, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    cfg = _small(torture, tmp_path / "ckpt", seed=5)
    assert torture.save_steps(cfg, root, 3) == ""
    tracker = torture.Tracker()
    assert torture.check_storage(root, cfg, tracker) == []
    newest = tracker.last[-1]
    os.unlink(os.path.join(root, manifest_path(newest)))
    problems = torture.check_storage(root, cfg, tracker)
    assert any("went backwards" in p for p in problems), problems
    assert any(f"committed step {newest} vanished" in p for p in problems), problems


def test_checker_compares_bytes_not_only_checksums(torture: ModuleType, tmp_path: Path) -> None:
    """A checkpoint that verifies but holds other bytes than the state that was saved."""
    root = str(tmp_path / "ckpt")
    cfg = _small(torture, tmp_path / "ckpt", seed=5)
    assert torture.save_steps(cfg, root, 2) == ""
    other = _small(torture, tmp_path / "ckpt", seed=6)  # expects different content
    problems = torture.check_storage(root, other, torture.Tracker())
    assert not any(p.startswith("verify") for p in problems)
    assert any("blob differs from the saved state" in p for p in problems), problems


def test_torture_catches_a_gc_that_removes_the_manifest_last(
    torture: ModuleType, tmp_path: Path
) -> None:
    """With the engine broken on purpose (GC deletes a step's manifest after its index
    files), a self-kill between two GC deletions leaves a visible step with missing files
    and the checker reports it: the kill instants do reach inside a GC."""
    shm_dir = tempfile.mkdtemp(prefix="stalwart-torture-", dir="/dev/shm")
    try:
        for op in range(12):
            root = str(tmp_path / f"ckpt{op}")
            cfg = _small(torture, Path(root), seed=5, inject_bug="gc-manifest-last")
            assert torture.save_steps(cfg, root, 3) == ""
            tracker = torture.Tracker()
            assert torture.check_storage(root, cfg, tracker) == []
            plan = torture.KillPlan("op", "gc", nth=1, op=op)
            events, problems = torture.kill_once(
                cfg, root, shm_dir, plan, str(tmp_path / "child.err")
            )
            assert problems == [] and events[-1]["e"] == "gc", (problems, events[-3:])
            problems = torture.check_storage(root, cfg, tracker)
            if problems:
                break
        else:
            pytest.fail("no kill inside the broken GC was detected")
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    assert any("is missing" in p for p in problems), problems


def test_cli_prints_summary_json(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--instants",
            "2",
            "--seed",
            "1",
            "--rank-bytes",
            str(256 << 10),
            "--root",
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=scaled(90),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["instants"] == 2 and last["failures"] == 0
    assert {"committed_steps_seen", "seconds"} <= last.keys()
    assert "2 kill instants, 0 failures" in proc.stdout
