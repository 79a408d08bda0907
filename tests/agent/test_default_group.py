"""The default process group after ``stalwart.init()`` is the job's: ``dist.all_reduce``
with no ``group=`` sums over the current members (the new world after an elastic
shrink), replicas seeded per rank start equal (rank 0's state), and a user collective
in a step a peer's death failed raises StepFailedError; caught, the step is redone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ._launch import stalwart_run

JOB = Path(__file__).resolve().parent / "_default_group_job.py"


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in out.glob("*.jsonl") for line in f.read_text().splitlines()]


def _committed(recs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """step -> the records of its last attempt (the newest generation that ran it)."""
    done = [r for r in recs if "failed" not in r]
    last: dict[int, int] = {}
    for r in done:
        last[r["step"]] = max(last.get(r["step"], -1), r["gen"])
    out: dict[int, list[dict[str, Any]]] = {}
    for r in done:
        if r["gen"] == last[r["step"]]:
            out.setdefault(r["step"], []).append(r)
    return out


def _run(tmp_path: Path, name: str, args: list[str]) -> list[dict[str, Any]]:
    out = tmp_path / f"{name}-out"
    proc = stalwart_run(tmp_path / name, [*args, str(JOB), "--out", str(out)], timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _records(out)


@pytest.mark.timeout(200)
def test_flash_all_reduce_spans_the_job_and_replicas_start_equal(tmp_path: Path) -> None:
    recs = _run(tmp_path, "flash", ["--nproc-per-node", "3", "--chaos", "kill rank=1 at=step:5"])
    steps = _committed(recs)
    assert sorted(steps) == list(range(1, 13))
    for step, rs in steps.items():
        assert sorted(r["rank"] for r in rs) == [0, 1, 2], step
        assert all(r["world"] == 3 and r["sum"] == 6.0 for r in rs), step  # 1 + 2 + 3
        assert len({r["digest"] for r in rs}) == 1, f"replicas differ at step {step}"
    failed = [r for r in recs if "failed" in r]
    assert any(r["step"] == 5 for r in failed)  # a survivor's all_reduce raised, no zeros


@pytest.mark.timeout(200)
def test_elastic_all_reduce_follows_the_shrink(tmp_path: Path) -> None:
    recs = _run(
        tmp_path,
        "elastic",
        [
            "--nproc-per-node",
            "2:3",
            "--strategy",
            "elastic",
            "--chaos",
            "kill rank=2 at=step:5 permanent",
        ],
    )
    steps = _committed(recs)
    assert sorted(steps) == list(range(1, 13))
    for step, rs in steps.items():
        world = 3 if step < 5 else 2
        assert sorted(r["rank"] for r in rs) == list(range(world)), step
        assert all(r["world"] == world and r["sum"] == sum(range(1, world + 1)) for r in rs), step
        assert len({r["digest"] for r in rs}) == 1, f"replicas differ at step {step}"
