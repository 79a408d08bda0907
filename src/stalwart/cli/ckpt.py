"""``stalwart ckpt ls|verify|inspect|export|import|gc DIR``.

These commands import no torch except ``export``/``import`` (which need DCP), so
``ls`` and ``verify`` answer in a fraction of a second on a machine without a GPU stack.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

from stalwart.checkpoint.catalog import (
    load_index,
    load_manifest,
    require_checkpoint_root,
    verify_step,
)
from stalwart.checkpoint.format import PENDING_PREFIX, parse_step_dir
from stalwart.checkpoint.retention import RetentionPolicy, collect_garbage
from stalwart.checkpoint.storage import Storage, open_storage
from stalwart.errors import CheckpointError, ConfigError, StorageUnavailableError

__all__ = ["register"]


def _storage(args: argparse.Namespace) -> Storage:
    """The storage of ``args.dir``; ``--s3-endpoint`` for an ``s3://`` URL (else boto3's
    own settings: AWS_ENDPOINT_URL, the AWS config file)."""
    endpoint = getattr(args, "s3_endpoint", None)
    if endpoint is None:
        return open_storage(args.dir)
    if not args.dir.startswith("s3://"):
        raise ConfigError(f"--s3-endpoint is for s3:// URLs, not {args.dir!r}")
    from stalwart.checkpoint.storage import S3Config

    return open_storage(args.dir, s3=S3Config(endpoint_url=endpoint))


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _emit(args: argparse.Namespace, doc: Any, lines: list[str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(lines))


def _ls(args: argparse.Namespace) -> int:
    storage = _storage(args)
    steps = require_checkpoint_root(storage)
    rows: list[dict[str, Any]] = []
    for step in steps:
        try:
            m = load_manifest(storage, step)
            rows.append(
                {
                    "step": step,
                    "world_size": m.world_size,
                    "total_bytes": m.total_bytes,
                    "new_bytes": m.new_bytes,
                    "created_unix": m.created_unix,
                    "generation": m.generation,
                    "ok": True,
                }
            )
        except CheckpointError as err:
            rows.append({"step": step, "ok": False, "error": str(err)})
    lines = [f"{'step':>10}  {'ranks':>5}  {'size':>10}  {'written':>10}  created"]
    for r in rows:
        if r["ok"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_unix"]))
            lines.append(
                f"{r['step']:>10}  {r['world_size']:>5}  {_human(r['total_bytes']):>10}  "
                f"{_human(r['new_bytes']):>10}  {when}"
            )
        else:
            lines.append(f"{r['step']:>10}  DAMAGED: {r['error']}")
    pending = _pending(storage)
    lines.insert(
        0,
        "trusted: MANIFEST.json on disk (no coordinator read); under `stalwart run` it is "
        "published only after the coordinator's fenced commit record"
        + (f"; {len(pending)} unpublished manifest(s) not trusted" if pending else ""),
    )
    doc = {"dir": args.dir, "checkpoints": rows, "trusted": "disk-manifest", "pending": pending}
    _emit(args, doc, lines)
    return 0


def _pending(storage: Storage) -> list[str]:
    """Manifests written under a pending name whose fenced record never came (a member
    fenced meanwhile): never trusted, removed by GC."""
    out = []
    for name in storage.listdir(""):
        if parse_step_dir(name) is not None and storage.kind(name) == "dir":
            out += [f"{name}/{n}" for n in storage.listdir(name) if n.startswith(PENDING_PREFIX)]
    return out


def _verify(args: argparse.Namespace) -> int:
    storage = _storage(args)
    steps = require_checkpoint_root(storage)
    if args.step is not None:
        if args.step not in steps:
            raise ConfigError(
                f"step {args.step} is not committed in {args.dir}; see `stalwart ckpt ls`"
            )
        steps = [args.step]
    elif not args.all:
        steps = steps[-1:]
    reports = [verify_step(storage, s, deep=not args.quick) for s in steps]
    ok = all(r.ok for r in reports)
    doc = {
        "dir": args.dir,
        "ok": ok,
        "steps": [
            {
                "step": r.step,
                "ok": r.ok,
                "problems": r.problems,
                "chunks_checked": r.chunks_checked,
                "bytes_checked": r.bytes_checked,
            }
            for r in reports
        ],
    }
    lines = []
    for r in reports:
        status = "ok" if r.ok else "BAD"
        lines.append(
            f"step {r.step}: {status} "
            f"({r.chunks_checked} chunks, {_human(r.bytes_checked)} checked)"
        )
        lines.extend(f"  {p}" for p in r.problems)
    _emit(args, doc, lines)
    return 0 if ok else 1


def _inspect(args: argparse.Namespace) -> int:
    storage = _storage(args)
    steps = require_checkpoint_root(storage)
    step = args.step if args.step is not None else steps[-1]
    m = load_manifest(storage, step)
    ranks = range(m.world_size) if args.rank is None else [args.rank]
    tensors: list[dict[str, Any]] = []
    for rank in ranks:
        if rank >= m.world_size:
            raise ConfigError(f"--rank {rank}: step {step} has ranks 0..{m.world_size - 1}")
        index = load_index(storage, m, rank)
        for t in index.tensors:
            tensors.append(
                {
                    "rank": rank,
                    "path": t.path,
                    "dtype": t.dtype,
                    "shape": t.shape,
                    "nbytes": t.nbytes,
                    "chunks": len(t.chunks),
                    "shard": t.shard,
                }
            )
    doc = {
        "step": step,
        "world_size": m.world_size,
        "generation": m.generation,
        "replicated": m.replicated,
        "total_bytes": m.total_bytes,
        "new_bytes": m.new_bytes,
        "packs": m.packs,
        "tensors": tensors,
    }
    lines = [
        f"step {step}: {m.world_size} rank(s), {_human(m.total_bytes)} "
        f"({_human(m.new_bytes)} newly written), {len(m.packs)} pack file(s)"
    ]
    for row in tensors:
        shape = "x".join(map(str, row["shape"])) or "scalar"
        lines.append(
            f"  r{row['rank']} {row['path']:<50} {row['dtype']:<9} {shape:<16} "
            f"{_human(row['nbytes'])}"
        )
    _emit(args, doc, lines)
    return 0


def _gc(args: argparse.Namespace) -> int:
    storage = _storage(args)
    require_checkpoint_root(storage)
    report = collect_garbage(storage, RetentionPolicy(args.keep_last, args.keep_every))
    print(
        f"deleted {len(report.deleted_steps)} checkpoint(s) {report.deleted_steps}, "
        f"{len(report.deleted_partial)} uncommitted step dir(s) {report.deleted_partial}, "
        f"{len(report.deleted_packs)} pack file(s), freed {_human(report.freed_bytes)}"
    )
    for why in report.skipped:
        print(f"  left alone (never followed): {why}")
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.format != "dcp":
        raise ConfigError(f"--format {args.format}: only 'dcp' is supported")
    from stalwart.checkpoint.dcp import export_dcp

    report = export_dcp(args.dir, args.out, step=args.step)
    print(report.summary())
    return 0


def _import(args: argparse.Namespace) -> int:
    from stalwart.checkpoint.dcp import import_dcp

    report = import_dcp(args.src, args.dir, step=args.step or 0, include=args.include)
    print(report.summary())
    return 0


def _endpoint_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--s3-endpoint",
        metavar="URL",
        help="S3 endpoint for an s3:// DIR (MinIO, Ceph, a test server); default: boto3's "
        "own (AWS_ENDPOINT_URL, the AWS config file, else AWS)",
    )


def _short(path: str, keep: int = 120) -> str:
    return path if len(path) <= keep else f"{path[:keep]}... ({len(path)} characters)"


def _one_line(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A path or URL that cannot be reached (a symlink loop, a name too long, a host that
    does not answer: OSError, aiohttp's connection errors included) ends the command with
    one line naming it, not a traceback."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except OSError as err:
            where = _short(str(getattr(args, "dir", "") or getattr(args, "src", "")))
            text = str(err).splitlines()
            why = err.strerror or (text[0] if text else type(err).__name__)
            raise StorageUnavailableError(
                f"{where}: cannot read the checkpoint root ({_short(str(why), 200)}); "
                "check the path or URL and that its host answers"
            ) from err

    return run


def register(sub: Any) -> None:
    p = sub.add_parser("ckpt", help="list, verify, inspect, export, import and clean checkpoints")
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)

    ls = cmds.add_parser("ls", help="list committed checkpoints")
    ls.add_argument("dir", help="checkpoint directory or URL (s3://bucket/prefix)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    _endpoint_flag(ls)
    ls.set_defaults(func=_one_line(_ls))

    v = cmds.add_parser("verify", help="check manifests, indexes and every chunk's checksum")
    v.add_argument("dir")
    v.add_argument("--step", type=int, help="verify this step (default: the newest)")
    v.add_argument("--all", action="store_true", help="verify every committed step")
    v.add_argument("--quick", action="store_true", help="skip reading chunks")
    v.add_argument("--json", action="store_true", help="print JSON")
    _endpoint_flag(v)
    v.set_defaults(func=_one_line(_verify))

    i = cmds.add_parser("inspect", help="show the tensors of a checkpoint")
    i.add_argument("dir")
    i.add_argument("--step", type=int, help="default: the newest")
    i.add_argument("--rank", type=int, help="default: every rank")
    i.add_argument("--json", action="store_true", help="print JSON")
    _endpoint_flag(i)
    i.set_defaults(func=_one_line(_inspect))

    e = cmds.add_parser("export", help="write a checkpoint in another format (DCP)")
    e.add_argument("dir")
    e.add_argument("out", help="output directory")
    e.add_argument("--format", default="dcp", help="output format (dcp)")
    e.add_argument("--step", type=int, help="default: the newest valid")
    e.set_defaults(func=_one_line(_export))

    im = cmds.add_parser("import", help="turn a DCP checkpoint into a stalwart checkpoint")
    im.add_argument("src", help="DCP checkpoint directory")
    im.add_argument("dir", help="stalwart checkpoint directory to write")
    im.add_argument("--step", type=int, help="step number to record (default 0)")
    im.add_argument(
        "--include",
        action="append",
        metavar="NAME",
        help="import only this top-level name (repeatable; default: all), e.g. model",
    )
    im.set_defaults(func=_one_line(_import))

    g = cmds.add_parser("gc", help="apply retention and delete unreferenced chunks")
    g.add_argument("dir")
    g.add_argument("--keep-last", type=int, default=RetentionPolicy.keep_last)
    g.add_argument("--keep-every", type=int, default=None)
    _endpoint_flag(g)
    g.set_defaults(func=_one_line(_gc))
