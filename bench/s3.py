"""S3 checkpoint benchmark: stalwart's persist and restore to a local S3 server (moto's, on
loopback) vs the plain client library putting the same bytes, in the same run.

A state of ``--size-gb`` (random fp32 tensors: incompressible) is snapshotted, then
persisted by the persister process to ``s3://bench-.../run`` (streamed multipart upload,
``--part-mb`` parts, ``--parallel`` of them at once), interleaved ``--reps`` times (the
first a warm-up, left out of the medians) with boto3's managed upload (``upload_fileobj``:
multipart, the same part size and concurrency) of the same bytes; each rep is a fresh step
with new bytes (no deduplication). Restore reads the newest step back as a fresh node
does (an empty local root, the step read from the bucket tier directly: ``restore_state(
local, ..., slower=[bucket])``), against boto3's ``download_fileobj`` of the same bytes
(as many requests in flight). The persister's peak private memory (RSS less the
shared-memory snapshot it maps, sampled every 10 ms) is reported against the bound
``(parallel + 1) x part`` per stream plus the pack writer's 16 MiB of bounce buffers,
above its size before the persist. DCP's fsspec writer (``thread_count`` = ``--parallel``)
saves states of the same size to the same server after our reps, from a side environment
with s3fs (bench/_dcp_fsspec.py; ``make bench-dcp-env`` makes it, ``make bench`` too); without
one it is reported as not measured.

Prints a table and, last, one JSON line. Needs ``moto[server]`` and boto3 (make setup).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    PersistConfig,
    open_storage,
    restore_state,
)
from stalwart.checkpoint.storage import S3Config
from stalwart.checkpoint.tiers import hydrate

MIB = 1 << 20
TENSOR_MB = 64


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"moto did not start: {log.read()[-2000:]!r}")
                time.sleep(0.1)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.kill()
            proc.wait(30)


def make_state(size_gb: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, round(size_gb * 1e9 / (TENSOR_MB * MIB)))
    return {f"w{i}": torch.randn(TENSOR_MB * MIB // 4, generator=g) for i in range(n)}


def state_bytes(state: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.numpy().tobytes() for t in state.values())


def _children(name: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and name.encode() in cmd:
            out.append(int(pid))
    return out


def private_rss(pid: int) -> int:
    """RSS less the shared-memory pages (the snapshot slot the persister maps)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0) - fields.get("RssShmem", 0)


class PeakSampler:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, private_rss(self.pid))
            time.sleep(0.01)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def client_put(endpoint: str, bucket: str, key: str, data: bytes, cfg: S3Config) -> float:
    import boto3
    from boto3.s3.transfer import TransferConfig

    c = boto3.session.Session().client("s3", endpoint_url=endpoint)
    tc = TransferConfig(
        multipart_threshold=cfg.part_bytes,
        multipart_chunksize=cfg.part_bytes,
        max_concurrency=cfg.parallel_parts,
    )
    t0 = time.perf_counter()
    c.upload_fileobj(io.BytesIO(data), bucket, key, Config=tc)
    return time.perf_counter() - t0


def client_get(endpoint: str, bucket: str, key: str, cfg: S3Config) -> float:
    import boto3
    from boto3.s3.transfer import TransferConfig

    c = boto3.session.Session().client("s3", endpoint_url=endpoint)
    tc = TransferConfig(multipart_chunksize=cfg.read_range_bytes, max_concurrency=cfg.read_threads)
    out = io.BytesIO()
    t0 = time.perf_counter()
    c.download_fileobj(bucket, key, out, Config=tc)
    return time.perf_counter() - t0


DCP_ENV = Path(__file__).resolve().parent / ".venv-dcp"  # make bench-dcp-env


def dcp_fsspec_put(
    endpoint: str, bucket: str, args: argparse.Namespace
) -> tuple[float | None, str]:
    """DCP's fsspec writer (``thread_count`` = our parallel parts) saving states of the
    same size, ``args.reps`` times (the first a warm-up, as ours), in a side environment
    with s3fs (bench/_dcp_fsspec.py says why); (median seconds, how it was measured)."""
    python = DCP_ENV / "bin" / "python"
    if importlib.util.find_spec("s3fs") is not None:
        python = Path(sys.executable)
    elif not python.exists():
        return (
            None,
            "not measured: s3fs is in neither this environment nor bench/.venv-dcp "
            "(make bench-dcp-env)",
        )
    argv = [str(python), str(Path(__file__).with_name("_dcp_fsspec.py")), endpoint, bucket]
    argv += [
        "--size-gb",
        str(args.size_gb),
        "--reps",
        str(args.reps),
        "--threads",
        str(args.parallel),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
    if out.returncode != 0:
        return None, f"failed: {out.stderr.strip().splitlines()[-1:]}"
    times = json.loads(out.stdout.strip().splitlines()[-1])["dcp_fsspec_s"]
    timed = times[1:] if len(times) > 1 else times
    return statistics.median(
        timed
    ), f"measured: thread_count {args.parallel}, {len(timed)} timed reps"


def run(args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    import boto3

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    cfg = S3Config(part_bytes=args.part_mb * MIB, parallel_parts=args.parallel)
    url = f"s3://{bucket}/run"
    ns = f"bench-s3-{uuid.uuid4().hex[:8]}"
    # not niced (a job's persister is: PersistConfig.nice): the boto3 peer runs at normal
    # priority in this process, and on a loaded machine a niced persister measures the load
    mgr = CheckpointManager(
        CheckpointConfig(url, namespace=ns, s3=cfg, persist=PersistConfig(nice=0))
    )
    ours: list[float] = []
    theirs: list[float] = []
    peaks: list[int] = []
    growth: list[int] = []
    restores: list[float] = []
    gets: list[float] = []
    disk_restores: list[float] = []
    idle = 0
    nbytes = 0
    try:
        for rep in range(args.reps):
            state = make_state(args.size_gb, seed=rep)
            data = state_bytes(state)
            nbytes = len(data)
            mgr.snapshot(state, rep + 1)
            mgr.persister.start()
            pid = _children("_persist_worker")[0]
            before = private_rss(pid)  # rep 0: before boto3 is imported there
            idle = idle or before
            with PeakSampler(pid) as sampler:
                res = mgr.persist().result()
            peaks.append(sampler.peak)
            if rep > 0 or args.reps == 1:
                growth.append(sampler.peak - before)
            ours.append(res.seconds)
            theirs.append(client_put(endpoint, bucket, f"plain/{rep}", data, cfg))
            del data
            print(f"rep {rep}: persist {ours[-1]:.2f} s, boto3 put {theirs[-1]:.2f} s", flush=True)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        bucket_tier = open_storage(url, s3=cfg)
        with tempfile.TemporaryDirectory() as fresh, tempfile.TemporaryDirectory() as disk:
            # the disk floor: the same step on local disk (copied there once; its reads
            # then come from the page cache, the fastest a restore can be here)
            hydrate(bucket_tier, open_storage(disk))
            for _ in range(args.restore_reps):  # interleaved: the load hits all three
                # a fresh node: an empty local root, the step read from the bucket directly
                for t in target.values():
                    t.zero_()
                t0 = time.perf_counter()
                restored = restore_state(open_storage(fresh), target, slower=[bucket_tier])
                restores.append(time.perf_counter() - t0)
                assert restored.tier == url and restored.step == args.reps
                assert all(torch.equal(target[k], state[k]) for k in state), "restore differs"
                gets.append(client_get(endpoint, bucket, f"plain/{args.reps - 1}", cfg))
                t0 = time.perf_counter()
                assert restore_state(open_storage(disk), target).step == args.reps
                disk_restores.append(time.perf_counter() - t0)
    finally:
        mgr.close()
    dcp_s, dcp_note = dcp_fsspec_put(endpoint, bucket, args)
    # rep 0 warms up (the persister imports boto3, maps the slot): left out when there are more
    timed = slice(1, None) if args.reps > 1 else slice(None)
    persist_s, put_s = statistics.median(ours[timed]), statistics.median(theirs[timed])
    restore_s, get_s = statistics.median(restores), statistics.median(gets)
    disk_s = statistics.median(disk_restores)
    # the part buffers of one stream, plus the pack writer's two 8 MiB bounce buffers
    # (checkpoint/_writer.py), which every backend has
    bound = (cfg.parallel_parts + 1) * cfg.part_bytes + 2 * 8 * MIB
    return {
        "remote_persist_s": round(persist_s, 3),
        "client_put_s": round(put_s, 3),
        "persist_vs_client_throughput": round(put_s / persist_s, 3),
        "dcp_fsspec_persist_s": None if dcp_s is None else round(dcp_s, 3),
        "dcp_fsspec_note": dcp_note,
        "persist_vs_dcp_fsspec_throughput": None if dcp_s is None else round(dcp_s / persist_s, 3),
        "remote_restore_s": round(restore_s, 3),
        "client_get_s": round(get_s, 3),
        "restore_vs_client_get_throughput": round(get_s / restore_s, 3),
        "disk_restore_s": round(disk_s, 3),
        "restore_vs_disk_throughput": round(disk_s / restore_s, 3),
        "client_get_vs_disk_throughput": round(disk_s / get_s, 3),
        "restore_reps": args.restore_reps,
        "state_bytes": nbytes,
        "persister_idle_rss_bytes": idle,
        "persister_peak_rss_bytes": max(peaks),
        "persister_rss_growth_bytes": max(growth),
        "memory_bound_bytes": bound,
        "part_bytes": cfg.part_bytes,
        "parallel_parts": cfg.parallel_parts,
        "reps": args.reps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--restore-reps", type=int, default=3)
    ap.add_argument("--part-mb", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--endpoint", default=None, help="an S3 server to use (default: start moto)")
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    if args.endpoint:
        result = run(args, args.endpoint)
    else:
        with moto_server() as endpoint:
            result = run(args, endpoint)
    print(
        f"persist {result['remote_persist_s']} s vs boto3 {result['client_put_s']} s "
        f"({result['persist_vs_client_throughput']}x its throughput); restore "
        f"{result['remote_restore_s']} s vs boto3 get {result['client_get_s']} s "
        f"({result['restore_vs_client_get_throughput']}x) vs local disk "
        f"{result['disk_restore_s']} s ({result['restore_vs_disk_throughput']}x); persister peak "
        f"private RSS {result['persister_peak_rss_bytes']} B, growth during a persist "
        f"{result['persister_rss_growth_bytes']} B (bound {result['memory_bound_bytes']} B); "
        "DCP fsspec: "
        f"{result['dcp_fsspec_note']}"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
