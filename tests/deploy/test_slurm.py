"""deploy/slurm/stalwart.sbatch on a real (one-node) Slurm cluster: a 2-task job is two
stalwart nodes; a worker killed inside the job recovers in place without Slurm seeing it,
and a requeued job (what Slurm does when the allocation is lost) resumes from the run
directory's newest committed checkpoint. Both end with parameters bit-identical to a
fault-free run outside Slurm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _load import scaled

from ._slurm import SlurmCluster, running_slurm

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "stalwart.sbatch"
SCRIPT = ROOT / "examples" / "train_lm.py"
STEPS = 240
BIN = str(Path(sys.executable).parent)

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with running_slurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same training, fault-free, as one `stalwart run` of 2 workers (no Slurm)."""
    import torch

    root = tmp_path_factory.mktemp("reference")
    out = root / "final.pt"
    cmd = [f"{BIN}/stalwart", "run", "--nproc-per-node", "2", "--run-dir", str(root / "run")]
    done = subprocess.run(
        [*cmd, str(SCRIPT), "--steps", str(STEPS), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=scaled(240),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(torch.load(out))


def _submit(slurm: SlurmCluster, root: Path, *launch: str) -> int:
    port = _port()
    env = slurm.env
    env["PATH"] = f"{BIN}:{env['PATH']}"
    args = ["-n", "2", "--ntasks-per-node", "2", "--overcommit", "-o", str(root / "job.out")]
    args += [str(SBATCH), "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    args += ["--run-dir", str(root / "run"), *launch]
    args += [str(SCRIPT), "--steps", str(STEPS), "--out", str(root / "final.pt")]
    out = subprocess.run(
        ["sbatch", "--parsable", *args], env=env, capture_output=True, text=True, timeout=scaled(30)
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().split(";")[0])


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _finish(slurm: SlurmCluster, job: int, root: Path) -> str:
    try:
        state = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 300)
    finally:
        slurm.cancel(job)
    log = (root / "job.out").read_text() if (root / "job.out").exists() else ""
    assert state == "COMPLETED", log[-3000:]
    return log


def test_a_worker_killed_in_a_slurm_job_recovers_in_place(
    slurm: SlurmCluster, reference: dict[str, Any], tmp_path: Path
) -> None:
    import torch

    job = _submit(slurm, tmp_path, "--chaos", "kill rank=1 at=step:40")
    log = _finish(slurm, job, tmp_path)
    assert slurm.job_field(job, "Restarts") == "0", log  # Slurm never saw the fault
    kinds = [e["kind"] for e in _events(tmp_path / "run")]
    assert "recovery_end" in kinds, log[-3000:]
    assert _same(dict(torch.load(tmp_path / "final.pt")), reference)


def test_a_requeued_slurm_job_resumes_from_its_checkpoint(
    slurm: SlurmCluster, reference: dict[str, Any], tmp_path: Path
) -> None:
    import torch

    run_dir = tmp_path / "run"
    job = _submit(slurm, tmp_path, "--persist-every", "20")
    try:
        deadline = time.monotonic() + 180
        committed = -1
        while committed < 40:
            assert time.monotonic() < deadline, "no checkpoint of step >= 40 was committed"
            ends = [e for e in _events(run_dir) if e["kind"] == "persist_end" and e["ok"]]
            committed = max((int(e["step"]) for e in ends), default=-1)
            time.sleep(0.1)
        slurm.scontrol("requeue", str(job))  # as Slurm does when the allocation is lost
        slurm.wait_state(job, {"PENDING"}, 120)
        slurm.scontrol("update", f"JobId={job}", "StartTime=now")  # skip the requeue delay
    except BaseException:
        slurm.cancel(job)
        raise
    log = _finish(slurm, job, tmp_path)
    assert slurm.job_field(job, "Restarts") == "1", log
    assert "requeued 1 time(s)" in log, log[-3000:]
    restores = [e for e in _events(run_dir) if e["kind"] == "restore"]
    assert restores and all(e["tier"] == "disk" for e in restores), log[-3000:]
    assert min(int(e["step"]) for e in restores) >= committed, restores
    assert (run_dir / "prev" / "1" / "events.jsonl").exists()  # the first attempt's records
    assert _same(dict(torch.load(tmp_path / "final.pt")), reference)
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("stalwart-slurm")]
