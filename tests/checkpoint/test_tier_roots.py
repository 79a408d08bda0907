"""Every checkpoint root of a job's ``ckpt/`` goes to the bucket tier, not only the top
one: each rank's own root (``rank<N>``), each replica group's (``group<g>``,
``group<g>/rank<N>``) and each DDP rank's part (``per-rank/rank<N>``) to its twin at the
same path under the tier's prefix; with the disk gone, each is restored from its twin."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _s3_server import CREDENTIALS, MotoServer, new_bucket

from stalwart.checkpoint import CheckpointConfig, CheckpointManager, RetentionPolicy
from stalwart.checkpoint.storage import LocalStorage, S3Config, S3Storage
from stalwart.checkpoint.tiers import TierCommit, TierUploader, behind_roots, checkpoint_roots

ROOTS = ["", "group1", "group1/rank0", "per-rank/rank00001", "rank0", "rank1"]


def _state(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(1 << 16, generator=g), "b": torch.full((3,), float(i))}


@pytest.mark.process  # the checkpoint persister
def test_every_checkpoint_root_is_tiered_and_restored_from_its_twin(
    moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shm_namespace: str
) -> None:
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    remote = S3Storage(f"s3://{new_bucket(moto.url)}/run", S3Config(endpoint_url=moto.url))
    ckpt = tmp_path / "ckpt"
    for i, rel in enumerate(ROOTS):
        mgr = CheckpointManager(CheckpointConfig(str(ckpt / rel), namespace=f"{shm_namespace}s{i}"))
        try:
            mgr.save(_state(i), 5)
        finally:
            mgr.close()
    commits: list[TierCommit] = []
    errors: list[str] = []
    up = TierUploader(
        LocalStorage(str(ckpt)), remote, commits.append, errors.append, 0.5, RetentionPolicy(2)
    )
    up.upload_newest()
    assert errors == []
    # the DDP part goes up with the top root's step (before its manifest): no event of its own
    tiers = sorted(c.tier for c in commits)
    assert tiers == sorted(f"{remote.url}/{r}".rstrip("/") for r in ROOTS if "per-rank" not in r)
    assert sorted(checkpoint_roots(remote)) == ROOTS
    commits.clear()
    up.upload_newest()  # nothing new: nothing sent again
    assert (commits, errors) == ([], [])

    shutil.rmtree(ckpt)  # the node's disk is gone
    fresh = tmp_path / "fresh"
    assert behind_roots(remote, LocalStorage(str(fresh))) == {r: 5 for r in ROOTS}
    for i, rel in enumerate(ROOTS):
        twin = f"{remote.url}/{rel}".rstrip("/")
        cfg = CheckpointConfig(
            str(fresh / rel),
            namespace=f"{shm_namespace}f{i}",
            tiers=(twin,),
            tier_s3=remote.config,
        )
        mgr = CheckpointManager(cfg)
        state = {k: torch.zeros_like(v) for k, v in _state(i).items()}
        try:
            result = mgr.restore(state)
        finally:
            mgr.close()
        assert (result.step, result.tier) == (5, twin), rel
        for k, v in _state(i).items():
            assert torch.equal(state[k], v), (rel, k)  # bit-identical, from its own twin
