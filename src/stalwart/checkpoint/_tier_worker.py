"""The bucket tier's uploader process (``python -m stalwart.checkpoint._tier_worker``).

A process, not a thread of the agent: copying and checksumming gigabytes holds a GIL, and
the agent's own threads (its lease, the workers' watch) must keep theirs. It runs niced,
copies each step newly committed in the local root to the bucket (checkpoint/tiers.py), and
ends, after a last upload of the newest local step, when its stdin closes (the agent's
close, or the agent gone). Arguments: one JSON object ``{"local", "remote", "s3",
"keep_last", "keep_every", "protect", "interval_s", "nice"}`` (``protect``: steps the
bucket's retention keeps whatever ``keep_last`` says). Output, one JSON object per line:
``{"commit": {"tier", "step", "seconds", "lag_s", "bytes"}}`` or ``{"error": "<one line>"}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading

from stalwart.checkpoint.retention import RetentionPolicy
from stalwart.checkpoint.storage import S3Config, open_storage
from stalwart.checkpoint.tiers import TierCommit, TierUploader

__all__ = ["main"]


def _say(doc: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    req = json.loads(argv[0])
    if int(req.get("nice", 0)):
        os.nice(int(req["nice"]))
    s3 = S3Config(**req["s3"]) if isinstance(req.get("s3"), dict) else None
    local = open_storage(str(req["local"]))
    remote = open_storage(str(req["remote"]), s3=s3)
    keep_every = req.get("keep_every")
    keep = RetentionPolicy(int(req["keep_last"]), None if keep_every is None else int(keep_every))

    def committed(c: TierCommit) -> None:
        _say({"commit": dataclasses.asdict(c)})

    def failed(why: str) -> None:
        _say({"error": why})

    protect = [int(s) for s in req.get("protect") or []]
    interval = float(req.get("interval_s", 0.5))
    uploader = TierUploader(local, remote, committed, failed, interval, keep, protect).start()
    done = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()  # returns at EOF: the agent closed it, or is gone
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    done.wait()
    uploader.close()
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))
