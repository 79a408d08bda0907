"""The job's bucket tier (``stalwart run --ckpt-tier s3://bucket/prefix``), on node 0.

Before the workers start, each checkpoint root of ``ckpt/`` (the top, ``rank<N>``,
``group<g>``, ``per-rank/rank<N>``: checkpoint/tiers.py ``checkpoint_roots``) that holds no
step as new as its bucket twin's newest (a fresh node, a lost disk) is noted: the workers
read that step from the bucket directly (``WorkerEnv.ckpt_tier``; no copy to local disk
first), and the bucket's retention keeps it for the whole job, whatever
``--tier-keep-last`` says. While the job runs, an uploader process
(checkpoint/_tier_worker.py: niced, and off the agent's GIL) copies every step committed in
each root of ``ckpt/`` (the fast, acknowledged tier) to its twin in the bucket, manifest
last; each is recorded as a ``tier_commit`` event (its upload time and its lag behind the
local commit); the bucket keeps ``--tier-keep-last``/``--tier-keep-every`` steps per root
(by default ckpt/'s ``--keep-last``/``--keep-every``). At the job's end the uploader copies
the newest local step of each root before it exits (the agent waits for it).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable

from stalwart.agent.config import LaunchConfig
from stalwart.checkpoint import open_storage
from stalwart.checkpoint.storage import S3Config, storage_options
from stalwart.checkpoint.tiers import behind_roots
from stalwart.metrics.events import EventLog

__all__ = ["start_tier"]

_FINAL_UPLOAD_S = 600.0  # the job's last step, at its end: then the uploader is killed


def start_tier(
    cfg: LaunchConfig, run_dir: str, events: EventLog, say: Callable[[str], None]
) -> Callable[[], None] | None:
    """Note a ``run_dir/ckpt`` behind the bucket (restored from the bucket), start the uploader;
    returns its close (upload the newest step, then stop), or None without a tier."""
    if cfg.ckpt_tier is None or cfg.node_rank != 0:
        return None
    s3 = S3Config(endpoint_url=cfg.s3_endpoint) if cfg.s3_endpoint else None
    remote = open_storage(cfg.ckpt_tier, s3=s3)
    ckpt = os.path.join(run_dir, "ckpt")
    restored = behind_roots(remote, open_storage(ckpt))  # per checkpoint root
    for rel, step in sorted(restored.items()):
        where = f"ckpt/{rel}" if rel else "ckpt/"
        why = (
            f"{where} has no checkpoint as new as step {step} of the bucket tier "
            f"{remote.url}: the workers restore it from the bucket directly"
        )
        say(why)
        events.emit("note", message=why)
    keep_last, keep_every = cfg.tier_retention()
    request = {
        "local": ckpt,
        "remote": remote.url,
        "s3": storage_options(remote),
        "keep_last": keep_last,
        "keep_every": keep_every,
        "protect": sorted(set(restored.values())),  # what the workers may be reading
        "interval_s": 0.5,
        "nice": 10,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart.checkpoint._tier_worker", json.dumps(request)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    reader = threading.Thread(
        target=_relay, args=(proc, remote.url, events, say), name="stalwart-tier", daemon=True
    )
    reader.start()

    def close() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the uploader copies the newest step, then exits
        try:
            proc.wait(_FINAL_UPLOAD_S)
        except subprocess.TimeoutExpired:
            say(f"bucket tier {remote.url}: the last upload took over {_FINAL_UPLOAD_S:.0f} s")
            proc.kill()
            proc.wait()
        reader.join(10)

    return close


def _relay(
    proc: subprocess.Popen[str], url: str, events: EventLog, say: Callable[[str], None]
) -> None:
    """The uploader's lines as events, until it exits."""
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc.get("commit"), dict):
            c = doc["commit"]
            events.emit(
                "tier_commit",
                tier=str(c["tier"]),
                step=int(c["step"]),
                seconds=float(c["seconds"]),
                lag_s=float(c["lag_s"]),
                bytes=int(c["bytes"]),
            )
        elif "error" in doc:
            why = f"bucket tier {url}: upload failed (tried again at the next step): {doc['error']}"
            say(why)
            events.emit("note", message=why)
