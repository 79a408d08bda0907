"""The job's bucket tier (``stalwart run --ckpt-tier s3://bucket/prefix``), on node 0.

Before the workers start, a run directory whose ``ckpt/`` holds no step as new as the
bucket's newest is filled from the bucket (a fresh node, a lost disk): the workers then
restore from local disk as on any restart. While the job runs, an uploader process
(checkpoint/_tier_worker.py: niced, and off the agent's GIL) copies every step committed in
``ckpt/`` (the fast, acknowledged tier) to the bucket, manifest last; each is recorded as a
``tier_commit`` event (its upload time and its lag behind the local commit); the bucket
keeps ``--keep-last``/``--keep-every`` steps like the local disk. At the job's end the
uploader copies the newest local step before it exits (the agent waits for it).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from stalwart.agent.config import LaunchConfig
from stalwart.checkpoint import open_storage
from stalwart.checkpoint.storage import S3Config, storage_options
from stalwart.checkpoint.tiers import hydrate
from stalwart.metrics.events import EventLog

__all__ = ["start_tier"]

_FINAL_UPLOAD_S = 600.0  # the job's last step, at its end: then the uploader is killed


def start_tier(
    cfg: LaunchConfig, run_dir: str, events: EventLog, say: Callable[[str], None]
) -> Callable[[], None] | None:
    """Hydrate ``run_dir/ckpt`` from the bucket when it is behind, start the uploader;
    returns its close (upload the newest step, then stop), or None without a tier."""
    if cfg.ckpt_tier is None or cfg.node_rank != 0:
        return None
    s3 = S3Config(endpoint_url=cfg.s3_endpoint) if cfg.s3_endpoint else None
    remote = open_storage(cfg.ckpt_tier, s3=s3)
    ckpt = os.path.join(run_dir, "ckpt")
    t0 = time.perf_counter()
    step = hydrate(remote, open_storage(ckpt))
    if step is not None:
        why = (
            f"checkpoint step {step} copied from the bucket tier {remote.url} into ckpt/ "
            f"in {time.perf_counter() - t0:.1f} s (ckpt/ had no step as new): resuming from it"
        )
        say(why)
        events.emit("note", message=why)
    request = {
        "local": ckpt,
        "remote": remote.url,
        "s3": storage_options(remote),
        "keep_last": cfg.runtime.keep_last,
        "keep_every": cfg.runtime.keep_every or None,
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
