"""DCP's fsspec writer putting a state to an S3 server: the peer of bench/s3.py.

Run by bench/s3.py with the interpreter of a side environment (``bench/.venv-dcp``, made
by ``make bench-dcp-env``): s3fs pins, through aiobotocore, an older botocore than the
boto3 the project's S3 storage installs, so the two cannot share one environment. This file
imports only torch and s3fs (never stalwart) and builds the same state bench/s3.py does
(the same sizes and generator). One line of JSON on stdout: the seconds of each save.

    python bench/_dcp_fsspec.py ENDPOINT BUCKET --size-gb 1 --reps 3 --threads 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

MIB = 1 << 20
TENSOR_MB = 64  # bench/s3.py's tensor size: the same state, tensor for tensor


def make_state(size_gb: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, round(size_gb * 1e9 / (TENSOR_MB * MIB)))
    return {f"w{i}": torch.randn(TENSOR_MB * MIB // 4, generator=g) for i in range(n)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("endpoint")
    ap.add_argument("bucket")
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="FsspecWriter's thread_count")
    ap.add_argument("--seed", type=int, default=99)
    args = ap.parse_args()
    times = []
    for rep in range(args.reps):
        state = make_state(args.size_gb, seed=args.seed + rep)  # new bytes every rep
        writer = FsspecWriter(
            f"s3://{args.bucket}/dcp-{uuid.uuid4().hex[:6]}",
            thread_count=args.threads,
            client_kwargs={"endpoint_url": args.endpoint},
        )
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer, no_dist=True)
        times.append(time.perf_counter() - t0)
        print(f"dcp fsspec rep {rep}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
    print(json.dumps({"dcp_fsspec_s": times, "threads": args.threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
