"""A worker's checkpoint roots and their twins in the job's bucket tier (``--ckpt-tier``):
the same path under the tier's prefix, read directly by a restore; none without a tier."""

from __future__ import annotations

from stalwart.contract.env import WorkerEnv
from stalwart.runtime.state._tier_roots import tier_options


def test_each_root_has_its_bucket_twin() -> None:
    env = WorkerEnv(ckpt_tier="s3://b/job/", s3_endpoint="http://127.0.0.1:9")
    shared = tier_options(env, "/r", "/r/ckpt")
    assert shared["tiers"] == ("s3://b/job",)
    assert shared["tier_s3"].endpoint_url == "http://127.0.0.1:9"
    part = tier_options(env, "/r", "/r/ckpt/per-rank/rank00001")
    assert part["tiers"] == ("s3://b/job/per-rank/rank00001",)
    assert tier_options(WorkerEnv(), "/r", "/r/ckpt") == {}  # no tier: nothing read remotely
