"""Restore straight from the bucket tier (moto's S3 server): a root that lost its steps
reads the bucket's newest step directly (no copy to local disk), bit-identical; a corrupt
object in the bucket falls back to an older step with one line; the bucket's retention
is its own (keep 2 in the bucket, 1 on disk) and keeps what a restore may be reading."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _s3_server import CREDENTIALS, MotoServer, client, new_bucket

from stalwart.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    RetentionPolicy,
    committed_steps,
    verify_step,
)
from stalwart.checkpoint.catalog import load_manifest
from stalwart.checkpoint.storage import LocalStorage, S3Config, S3Storage
from stalwart.checkpoint.tiers import TierCommit, TierUploader, behind


def _bucket(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> S3Storage:
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    return S3Storage(f"s3://{new_bucket(moto.url)}/run", S3Config(endpoint_url=moto.url))


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(1 << 18, generator=g), "b": torch.zeros(5)}


def _persist(
    tmp_path: Path, remote: S3Storage, ns: str, steps: list[int], keep: int, remote_keep: int
) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps`` to ``tmp_path/a`` (keeping ``keep``), each uploaded to ``remote``
    (keeping ``remote_keep``); returns the state saved at each step."""
    root = str(tmp_path / "a")
    mgr = CheckpointManager(CheckpointConfig(root, namespace=ns, retention=RetentionPolicy(keep)))
    errors: list[str] = []
    commits: list[TierCommit] = []
    up = TierUploader(
        LocalStorage(root),
        remote,
        commits.append,
        errors.append,
        retention=RetentionPolicy(remote_keep),
    )
    state, saved = _state(), {}
    try:
        for step in steps:
            state["b"] += step
            mgr.save(state, step)
            saved[step] = {k: v.clone() for k, v in state.items()}
            up.upload_newest()  # the uploader's round, here and now
    finally:
        mgr.close()
    assert errors == [] and [c.step for c in commits] == steps
    return saved


def _fresh(tmp_path: Path, remote: S3Storage, ns: str) -> CheckpointManager:
    cfg = CheckpointConfig(
        str(tmp_path / "fresh"), namespace=ns, tiers=(remote.url,), tier_s3=remote.config
    )
    return CheckpointManager(cfg)


def _zeroed() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state().items()}


@pytest.mark.process  # the checkpoint persister
def test_restore_reads_the_bucket_directly(
    moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shm_namespace: str
) -> None:
    remote = _bucket(moto, monkeypatch)
    saved = _persist(tmp_path, remote, shm_namespace, [1, 2], keep=3, remote_keep=3)
    shutil.rmtree(tmp_path / "a")  # the node's disk is gone
    mgr = _fresh(tmp_path, remote, shm_namespace)
    try:
        assert behind(remote, mgr.storage) == 2
        assert mgr.steps() == [1, 2]
        state = _zeroed()
        result = mgr.restore(state)
    finally:
        mgr.close()
    assert (result.step, result.tier, result.skipped) == (2, remote.url, [])
    for k, v in saved[2].items():
        assert torch.equal(state[k], v), k  # bit-identical
    assert committed_steps(LocalStorage(str(tmp_path / "fresh"))) == []  # nothing copied
    assert result.bytes_read >= saved[2]["w"].numel() * 4


@pytest.mark.process
def test_a_corrupt_object_in_the_bucket_falls_back_one_step(
    moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shm_namespace: str
) -> None:
    remote = _bucket(moto, monkeypatch)
    saved = _persist(tmp_path, remote, shm_namespace, [1, 2], keep=3, remote_keep=3)
    shutil.rmtree(tmp_path / "a")
    fresh_packs = set(load_manifest(remote, 2).packs) - set(load_manifest(remote, 1).packs)
    assert fresh_packs, "step 2 wrote no pack of its own"
    pack = sorted(fresh_packs)[0]
    data = bytearray(remote.read(pack))
    data[len(data) // 2] ^= 0xFF  # one flipped bit-pattern, same size
    client(moto.url).put_object(
        Bucket=remote.bucket, Key=f"{remote.prefix}/{pack}", Body=bytes(data)
    )
    mgr = _fresh(tmp_path, remote, shm_namespace)
    try:
        state = _zeroed()
        result = mgr.restore(state)
    finally:
        mgr.close()
    assert result.step == 1 and result.tier == remote.url
    assert len(result.skipped) == 1 and result.skipped[0].startswith(f"step 2 ({remote.url})")
    for k, v in saved[1].items():
        assert torch.equal(state[k], v), k
    assert 2 in committed_steps(remote)  # the bucket is only read, never changed by a restore


@pytest.mark.process
def test_retention_per_tier_keeps_what_a_restore_needs(
    moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shm_namespace: str
) -> None:
    remote = _bucket(moto, monkeypatch)
    saved = _persist(tmp_path, remote, shm_namespace, [1, 2, 3, 4], keep=1, remote_keep=2)
    assert committed_steps(LocalStorage(str(tmp_path / "a"))) == [4]
    assert committed_steps(remote) == [3, 4]
    for step in (3, 4):  # the bucket's deletions took no pack a kept step needs
        assert verify_step(remote, step).ok, step

    # a step a restore is reading (the one the job resumed from) outlives keep_last
    up = TierUploader(
        LocalStorage(str(tmp_path / "a")),
        remote,
        lambda c: None,
        pytest.fail,
        retention=RetentionPolicy(1),
        protect=[3],
    )
    mgr = CheckpointManager(
        CheckpointConfig(str(tmp_path / "a"), namespace=shm_namespace, retention=RetentionPolicy(1))
    )
    try:
        state = _zeroed()
        mgr.restore(state)
        mgr.save(state, 5)
        up.upload_newest()
    finally:
        mgr.close()
    assert committed_steps(remote) == [3, 5]
    assert verify_step(remote, 3).ok and verify_step(remote, 5).ok
    shutil.rmtree(tmp_path / "a")
    fresh = _fresh(tmp_path, remote, shm_namespace)
    try:
        state = _zeroed()
        assert fresh.restore(state).step == 5
    finally:
        fresh.close()
    for k, v in saved[4].items():
        assert torch.equal(state[k], v), k  # step 5 saved step 4's restored state
