"""A snapshot that will not fit in /dev/shm is refused before it starts (not killed
mid-copy by SIGBUS), and the snapshots already there stay intact."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.checkpoint import SnapshotConfig, Snapshotter, _shm
from stalwart.errors import SnapshotWontFitError


def test_second_slot_that_does_not_fit_is_refused_on_a_real_tmpfs(small_tmpfs: Path) -> None:
    snap = Snapshotter(SnapshotConfig("fit-job-rank0", shm_dir=str(small_tmpfs)))
    state = {"w": torch.ones(1_250_000)}  # 5 MB: one slot fits in 8 MB, two do not
    try:
        snap.snapshot(state, 1)
        state["w"].add_(1)
        with pytest.raises(SnapshotWontFitError, match=r"step 2 needs .* refused before"):
            snap.snapshot(state, 2)
        assert snap.steps() == [1]  # the older snapshot is intact
        state["w"].zero_()
        assert snap.restore(state) == 1 and float(state["w"][0]) == 1.0
    finally:
        snap.close(unlink=True)


def test_refusal_leaves_slots_untouched_and_a_mapped_slot_is_not_rechecked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snap = Snapshotter(SnapshotConfig("fit-job-rank1", shm_dir=str(tmp_path)))
    state = {"w": torch.ones(100_000)}
    real = os.statvfs
    full: dict[str, Any] = {"on": False}

    def statvfs(path: Any) -> Any:
        st = real(path)
        if not full["on"]:
            return st
        return os.statvfs_result((st.f_bsize, st.f_frsize, 0, 0, 0, 0, 0, 0, 0, 255))

    monkeypatch.setattr(_shm.os, "statvfs", statvfs)
    try:
        snap.snapshot(state, 1)
        snap.snapshot(state, 2)  # both slots now mapped at full size
        full["on"] = True
        snap.snapshot(state, 3)  # no growth: nothing to check, it goes through
        assert snap.steps() == [2, 3]
        grown = {"w": torch.ones(200_000)}
        with pytest.raises(SnapshotWontFitError):
            snap.snapshot(grown, 4)
        assert snap.steps() == [2, 3]
    finally:
        snap.close(unlink=True)
