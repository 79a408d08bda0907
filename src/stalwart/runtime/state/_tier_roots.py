"""Where a worker's checkpoint roots live in the job's bucket tier (``--ckpt-tier``): the
same path under the tier's prefix. A restore reads the steps a local root lacks from its
twin directly (checkpoint/manager.py ``tiers``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.contract.env import WorkerEnv

__all__ = ["tier_options"]


def tier_options(env: WorkerEnv, run_dir: str, root: str) -> dict[str, Any]:
    """``CheckpointConfig``'s ``tiers`` and ``tier_s3`` for the checkpoint root ``root``
    under ``run_dir/ckpt``: the same path under the job's bucket tier (``--ckpt-tier``),
    which a restore reads directly for the steps ``root`` lacks; none without a tier."""
    if not env.ckpt_tier:
        return {}
    from stalwart.checkpoint.storage import S3Config

    rel = os.path.relpath(root, os.path.join(run_dir, "ckpt")).replace(os.sep, "/")
    url = env.ckpt_tier.rstrip("/") + ("" if rel == "." else f"/{rel}")
    s3 = S3Config(endpoint_url=env.s3_endpoint) if env.s3_endpoint else None
    return {"tiers": (url,), "tier_s3": s3}
