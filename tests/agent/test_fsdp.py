"""FSDP2 under flash: survivors keep their FSDP module and optimizer across a re-formed
group, and the run ends with the same parameters, bit for bit, as one without faults.
Under restart with --persist-every: the same from the job's multi-rank checkpoint; and a
4-worker checkpoint resumed by 2 workers goes on as a 2-worker run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ._launch import events_of, stalwart_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_fsdp.py"
ARGS = ["--steps", "16", "--dim", "16", "--layers", "2", "--seq", "8", "--batch", "4"]


def _train(run_dir: Path, extra: list[str], timeout: float = 110) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}.pt"
    proc = stalwart_run(
        run_dir,
        ["--nproc-per-node", "2", *extra, str(EXAMPLE), *ARGS, "--out", str(out)],
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
    return state


@pytest.mark.timeout(240)
def test_fsdp2_flash_kill_and_hang_bit_identical(tmp_path: Path) -> None:
    reference = _train(tmp_path / "ref", [])
    # rank 1 is killed once the optimizer holds state (the replacement restores
    # DTensor moments into a fresh optimizer); rank 0 hangs later (a survivor's
    # collective fails, it rolls back in place)
    chaos = ["--chaos", "kill rank=1 at=step:4; hang rank=0 at=step:11"]
    faulty = _train(tmp_path / "flash", chaos)
    assert reference.keys() == faulty.keys()
    for name, tensor in reference.items():
        assert torch.equal(tensor, faulty[name]), name
    events = events_of(tmp_path / "flash")
    assert [f["fault"] for k, f in events if k == "fault_detected"] == ["crash", "hang"]
    ends = [f for k, f in events if k == "recovery_end"]
    assert [f["source_tier"] for f in ends] == ["memory", "memory"]
    assert [f["status"] for k, f in events if k == "run_end"] == ["ok"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_restart_with_persist_every_is_bit_identical(tmp_path: Path) -> None:
    """4 workers under --strategy restart: every rank persists its shard into one
    multi-rank checkpoint; a kill -9 relaunches all of them from it, and the run ends
    with the fault-free run's parameters, bit for bit."""
    four = ["--nproc-per-node", "4"]
    reference = _train(tmp_path / "ref", four, timeout=200)
    flags = [*four, "--strategy", "restart", "--max-restarts", "2", "--persist-every", "3"]
    faulty = _train(tmp_path / "restart", [*flags, "--chaos", "kill rank=2 at=step:8"], 200)
    for name, tensor in reference.items():
        assert torch.equal(tensor, faulty[name]), name
    events = events_of(tmp_path / "restart")
    restores = [f for k, f in events if k == "restore"]
    assert {f["tier"] for f in restores} == {"disk"} and len(restores) == 4
    assert {f["step"] for f in restores} <= {3, 6}
    # the final step committed (by the last rank to write it) as one 4-rank checkpoint
    assert 16 in [f["step"] for k, f in events if k == "persist_end" and f["ok"]]
    manifest = json.loads(
        (tmp_path / "restart" / "ckpt" / f"step_{16:012d}" / "MANIFEST.json").read_text()
    )
    assert manifest["world_size"] == 4 and len(manifest["indexes"]) == 4


def _losses(path: Path) -> dict[int, tuple[float, int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: (r["loss"], r["world"]) for r in rows}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_restarts_at_2_workers_from_a_4_worker_checkpoint(tmp_path: Path) -> None:
    """Persisted by 4 workers, resumed by 2 on the same --run-dir: parameters and Adam
    moments resharded, the loader re-partitions the epoch under a constant global batch;
    the loss goes on as a 2-worker run's (float tolerance: another reduction order)."""
    data = ["--global-batch", "16", "--samples", "512"]
    log, ref_log = tmp_path / "resharded.jsonl", tmp_path / "two.jsonl"
    run = tmp_path / "run"
    for nproc, steps in (("4", "6"), ("2", "12")):
        args = ["--nproc-per-node", nproc, "--persist-every", "3", str(EXAMPLE), *ARGS, *data]
        args = [*args, "--steps", steps, "--loss-log", str(log)]
        proc = stalwart_run(run, args, timeout=200)
        assert proc.returncode == 0, proc.stderr[-3000:]
    restores = [f for k, f in events_of(run) if k == "restore"]
    assert [(f["step"], f["tier"]) for f in restores] == [(6, "disk"), (6, "disk")]
    two = ["--nproc-per-node", "2", str(EXAMPLE), *ARGS, *data, "--steps", "12"]
    proc = stalwart_run(tmp_path / "ref", [*two, "--loss-log", str(ref_log)], timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _losses(log), _losses(ref_log)
    assert sorted(got) == list(range(1, 13))
    assert [got[s][1] for s in range(1, 13)] == [4] * 6 + [2] * 6
    for step in range(7, 13):
        assert got[step][0] == pytest.approx(want[step][0], rel=1e-5), step
