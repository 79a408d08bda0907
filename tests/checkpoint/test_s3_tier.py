"""The bucket tier: steps copied local -> bucket (manifest last), a fresh root filled from
the bucket, and the acceptance job: a job with a local checkpoint dir and a bucket tier is
killed whole, its run dir deleted, and a job on a fresh run dir resumes from the bucket
alone (read from the bucket directly, no copy to disk first) and ends bit-identical to a
straight run (moto's S3 server; tests/_tiers.py: e2e)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from _load import Deadline, wait_job
from _s3_server import CREDENTIALS, MotoServer, new_bucket, s3_env

from stalwart.checkpoint import CheckpointConfig, CheckpointManager, committed_steps, verify_step
from stalwart.checkpoint.storage import LocalStorage, S3Config, S3Storage
from stalwart.checkpoint.tiers import TierCommit, TierUploader, copy_step, hydrate
from stalwart.metrics.events import read_events
from stalwart.metrics.report import load_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
ARGS = ["--dim", "32", "--layers", "1", "--seq", "16", "--batch", "4"]


def _bucket_storage(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> S3Storage:
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    return S3Storage(f"s3://{new_bucket(moto.url)}/run", S3Config(endpoint_url=moto.url))


@pytest.mark.process  # the checkpoint persister
def test_copy_and_hydrate_through_the_bucket(
    moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shm_namespace: str
) -> None:
    remote = _bucket_storage(moto, monkeypatch)
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path / "a"), namespace=shm_namespace))
    state = {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.zeros(3)}
    commits: list[TierCommit] = []
    errors: list[str] = []
    local = LocalStorage(str(tmp_path / "a"))
    up = TierUploader(local, remote, commits.append, errors.append, interval_s=0.05).start()
    try:
        mgr.save(state, 1)
        state["b"] += 1
        mgr.save(state, 2)
    finally:
        mgr.close()
        up.close()  # uploads the newest local step before it returns
    assert errors == []
    assert commits and commits[-1].step == 2 and commits[-1].tier == remote.url
    assert 2 in committed_steps(remote) and verify_step(remote, 2).ok
    assert copy_step(local, remote, 2) == 0  # already there: nothing copied
    fresh = LocalStorage(str(tmp_path / "fresh"))
    assert hydrate(remote, fresh) == 2
    assert hydrate(remote, fresh) is None  # as new already
    assert committed_steps(fresh) == [2] and verify_step(fresh, 2).ok
    assert remote.multipart_uploads() == []


def _start(
    run_dir: Path, job: str, args: list[str], log: Path | None = None
) -> subprocess.Popen[str]:
    """``log``: the job's output goes there (nobody reads its pipes while it runs)."""
    cmd = [sys.executable, "-m", "stalwart.cli.main", "run", "--rdzv-id", job]
    out = open(log, "w") if log is not None else None  # noqa: SIM115 (closed below)
    try:
        return _popen(cmd, run_dir, args, out)
    finally:
        if out is not None:
            out.close()  # the child has its own copy


def _popen(cmd: list[str], run_dir: Path, args: list[str], out: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*cmd, "--run-dir", str(run_dir), *args],
        stdout=out or subprocess.PIPE,  # type: ignore[arg-type]
        stderr=subprocess.STDOUT if out else subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        cwd=str(run_dir.parent),
        start_new_session=True,  # its own process group: killed whole
    )


def _kinds(run_dir: Path) -> list[tuple[str, dict[str, object]]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [(e.kind, e.fields) for e in read_events(str(path)).events]


def _kill_job(proc: subprocess.Popen[str], job: str) -> None:
    """SIGKILL the job's whole process group (agent, zygote, workers, persisters), reap
    the agent, wait for the group to be gone, and remove the shared memory it left."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)
    if proc.stdout is not None:
        proc.stdout.close()
    deadline = Deadline(30)
    while not deadline.expired():
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    for name in os.listdir("/dev/shm"):
        if job in name:
            path = os.path.join("/dev/shm", name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)


@pytest.mark.timeout(400)
def test_job_resumes_from_the_bucket_alone(moto: MotoServer, tmp_path: Path) -> None:
    steps = 300
    with s3_env(moto.url):
        url = f"s3://{new_bucket(moto.url)}/job"
        tier = ["--ckpt-tier", url, "--persist-every", "4"]
        train = ["--nproc-per-node", "2", str(EXAMPLE), "--steps", str(steps), *ARGS]
        first = tmp_path / "first"
        first.mkdir()
        job = f"test-{uuid.uuid4().hex[:8]}"
        log = tmp_path / "first.log"
        proc = _start(first, job, [*tier, *train], log)
        try:
            deadline = Deadline(120)
            # the top root's commit: a DDP rank's part (per-rank/rank<N>) committed before
            # its step's manifest goes up on its own first, with an event of its own
            while not any(
                k == "tier_commit" and str(f["tier"]).rstrip("/") == url for k, f in _kinds(first)
            ):
                assert proc.poll() is None, f"ended before a bucket commit: {log.read_text()}"
                assert not deadline.expired(), f"no tier_commit in {deadline.describe()}"
                time.sleep(0.05)
        finally:
            _kill_job(proc, job)
        uploaded = committed_steps(S3Storage(url, S3Config(endpoint_url=moto.url)))
        assert uploaded, "the bucket holds no committed step"
        shutil.rmtree(first)  # the node's disk is gone

        fresh = tmp_path / "fresh"
        fresh.mkdir()
        proc = _start(
            fresh, f"test-{uuid.uuid4().hex[:8]}", [*tier, *train, "--out", str(tmp_path / "b.pt")]
        )
        _, err = wait_job(proc, 150, [fresh / "events.jsonl"])
        assert proc.returncode == 0, err[-3000:]
    straight = tmp_path / "straight"
    straight.mkdir()
    proc = _start(
        straight, f"test-{uuid.uuid4().hex[:8]}", [*train, "--out", str(tmp_path / "c.pt")]
    )
    _, err = wait_job(proc, 150, [straight / "events.jsonl"])
    assert proc.returncode == 0, err[-3000:]

    events = _kinds(fresh)
    notes = [str(f["message"]) for k, f in events if k == "note"]
    assert any(f"as new as step {uploaded[-1]} of the bucket tier" in n for n in notes)
    # read from the bucket directly: ckpt/ (and each rank's part) never held that step
    for root in [fresh / "ckpt", *(fresh / "ckpt" / "per-rank").glob("rank*")]:
        assert uploaded[-1] not in committed_steps(LocalStorage(str(root))), root
    restores = [f for k, f in events if k == "restore"]
    assert restores and all(f["step"] == uploaded[-1] for f in restores)
    resumed = torch.load(tmp_path / "b.pt", weights_only=True)
    want = torch.load(tmp_path / "c.pt", weights_only=True)
    assert resumed.keys() == want.keys()
    assert all(torch.equal(resumed[k], want[k]) for k in resumed)
    tiers = load_run(str(fresh)).to_dict()["checkpoint"]["tiers"]  # the report's figures
    assert tiers[url]["last_step"] == steps  # the job's last step, uploaded at its end
    assert tiers[url]["lag_s_max"] >= tiers[url]["lag_s_mean"] >= 0
