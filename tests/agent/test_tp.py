"""Tensor parallel beside FSDP2 under `stalwart run` (issue 15): a ("dp", "tp") mesh of
2 x 2 on CPU over gloo (examples/train_tp.py) computes what a single-process model does on
the whole global batch, to float rounding, through the mesh's generation-following groups."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ._launch import stalwart_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tp.py"

pytestmark = pytest.mark.timeout(400)


def test_fsdp2_with_tensor_parallel_matches_one_process(tmp_path: Path) -> None:
    proc = stalwart_run(
        tmp_path / "run", ["--nproc-per-node", "4", str(EXAMPLE), "--steps", "3"], timeout=360
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    num = r"\d+(?:\.\d+)?(?:e[+-]\d+)?"  # the workers' lines may run into each other
    found = re.findall(rf"rank (\d): forward max err ({num}) params max err ({num})", proc.stdout)
    assert sorted(int(r) for r, _, _ in found) == [0, 1, 2, 3], proc.stdout[-2000:]
    assert all(float(f) < 1e-5 and float(p) < 1e-5 for _, f, p in found), found
