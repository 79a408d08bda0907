"""Tiered persistence: a fast tier (local disk, acknowledged first) copied to a durable one
(a bucket) in the background, and a fresh node filled from the durable one.

A step is copied with the same order of writes as a persist, so the copy is committed and
verifiable or invisible on its own: the packs the step references that the target lacks
(streamed, ``piece_bytes`` at a time: memory stays bounded whatever a pack's size), then
each rank's index, then the manifest, last. A checkpoint root may hold nested checkpoint
roots (a DDP job's per-rank parts, ``per-rank/rank<N>``): they are copied the same way,
before the root's own manifest. A local step being uploaded is pinned first (hard links
under ``.tier-upload``), so the local retention can go on deleting it meanwhile. Each
tier's commit is recorded on its own:
:class:`TierUploader` reports a step's upload time and its lag behind the local commit.

:func:`behind` tells that the bucket holds a step newer than the local root's newest (a
fresh node, a lost disk): a restore then reads it from the bucket directly
(``restore_state(..., slower=[bucket])``: ranged, checksummed reads straight into the
tensors, no copy to local disk). :func:`hydrate` copies it to local disk instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from stalwart.checkpoint.catalog import committed_steps, load_manifest
from stalwart.checkpoint.format import manifest_path
from stalwart.checkpoint.retention import RetentionPolicy, collect_garbage
from stalwart.checkpoint.storage import (
    LocalStorage,
    S3Config,
    Storage,
    open_storage,
    storage_options,
)
from stalwart.checkpoint.storage.local import split_relpath
from stalwart.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "NESTED_ROOTS",
    "STAGING",
    "TierCommit",
    "TierUploader",
    "behind",
    "behind_roots",
    "checkpoint_roots",
    "copy_step",
    "hydrate",
    "pin_step",
]

NESTED_ROOTS = "per-rank"
"""A directory of a checkpoint root whose subdirectories are checkpoint roots themselves."""

STAGING = ".tier-upload"
"""Where a local step being uploaded is pinned by hard links (ignored by retention)."""

_PIECE = 16 << 20
_ROOT_NAME = re.compile(r"(rank|group)[0-9]+\Z")
_RANK = re.compile(r"rank[0-9]+\Z")


@dataclass(frozen=True)
class TierCommit:
    """A step committed on a tier: ``seconds`` to copy it, ``lag_s`` after its commit on
    the tier before (the local manifest's time), ``bytes`` copied (new packs only)."""

    tier: str
    step: int
    seconds: float
    lag_s: float
    bytes: int


def _copy_file(src: Storage, dst: Storage, path: str, piece_bytes: int) -> int:
    size = src.size(path)
    stream = dst.open_stream(path)
    buf = bytearray(min(piece_bytes, max(size, 1)))
    try:
        at = 0
        while at < size:
            n = min(len(buf), size - at)
            view = memoryview(buf)[:n]
            src.read_into(path, at, view)
            stream.write(view)
            at += n
        stream.commit()
    except BaseException:
        stream.abort()
        raise
    return size


def _nested(src: Storage) -> list[str]:
    return [f"{NESTED_ROOTS}/{n}" for n in src.listdir(NESTED_ROOTS)]


def _sub(storage: Storage, prefix: str) -> Storage:
    """The nested checkpoint root ``prefix`` of ``storage``, on the same backend."""
    options = storage_options(storage)
    s3 = S3Config(**options) if options is not None else None  # type: ignore[arg-type]
    return open_storage(f"{storage.url.rstrip('/')}/{prefix}", s3=s3)


def copy_step(src: Storage, dst: Storage, step: int, piece_bytes: int = _PIECE) -> int:
    """Copy committed ``step`` of ``src`` (and of its nested roots, where they committed
    it) to ``dst``, manifest last; returns the bytes copied. Already there: nothing."""
    if dst.exists(manifest_path(step)):
        return 0
    total = 0
    for prefix in _nested(src):
        sub_src = _sub(src, prefix)
        if step in committed_steps(sub_src):
            total += copy_step(sub_src, _sub(dst, prefix), step, piece_bytes)
    manifest = load_manifest(src, step)
    for pack in manifest.packs:
        if dst.kind(pack) != "file" or dst.size(pack) != src.size(pack):
            total += _copy_file(src, dst, pack, piece_bytes)
    for ref in manifest.indexes:
        dst.write_atomic(ref.path, src.read(ref.path))
    dst.write_atomic(manifest_path(step), src.read(manifest_path(step)))
    return total


def _link(src_root: str, dst_root: str, rel: str) -> None:
    split_relpath(rel)
    dst = os.path.join(dst_root, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.link(os.path.join(src_root, rel), dst, follow_symlinks=False)


def _link_step(src_root: str, dst_root: str, step: int) -> None:
    _link(src_root, dst_root, manifest_path(step))  # first: missing means superseded
    manifest = load_manifest(LocalStorage(dst_root), step)
    for rel in [r.path for r in manifest.indexes] + list(manifest.packs):
        _link(src_root, dst_root, rel)


def pin_step(local: LocalStorage, step: int) -> LocalStorage:
    """Hard links of ``step``'s files (its nested roots' too) under ``local/.tier-upload``:
    the local retention may then delete the step while it uploads. FileNotFoundError or
    CheckpointNotFoundError: the step was deleted first (a newer one superseded it)."""
    root = os.path.join(local.root, STAGING)
    shutil.rmtree(root, ignore_errors=True)
    _link_step(local.root, root, step)
    for prefix in _nested(local):
        sub = os.path.join(local.root, prefix)
        if os.path.isfile(os.path.join(sub, manifest_path(step))):
            _link_step(sub, os.path.join(root, prefix), step)
    return LocalStorage(root)


def behind(remote: Storage, local: Storage) -> int | None:
    """``remote``'s newest committed step when ``local`` has no step that new (a restore
    then reads it from ``remote``: ``restore_state(..., slower=[remote])``), else None."""
    steps = committed_steps(remote)
    have = committed_steps(local)
    if not steps or (have and have[-1] >= steps[-1]):
        return None
    return steps[-1]


def hydrate(remote: Storage, local: Storage) -> int | None:
    """Copy ``remote``'s newest committed step into ``local`` when ``local`` has no step
    that new; returns that step, or None when nothing was copied. (A restore needs no
    copy: it reads the bucket directly; this makes a local copy for keeps.)"""
    newest = behind(remote, local)
    if newest is not None:
        copy_step(remote, local, newest)
    return newest


def checkpoint_roots(storage: Storage) -> list[str]:
    """The checkpoint roots of a job's ``ckpt/`` (paths relative to it, ``""`` the top):
    the top, each rank's own (``rank<N>``: a state of its own per rank), each replica
    group's (``group<g>``, and ``group<g>/rank<N>``), and each DDP rank's part
    (``per-rank/rank<N>``). Each has its twin at the same path under a bucket tier."""
    roots = [""]
    for name in storage.listdir(""):
        if _ROOT_NAME.match(name):
            roots.append(name)
            if name.startswith("group"):
                roots += [f"{name}/{n}" for n in storage.listdir(name) if _RANK.match(n)]
    return roots + _nested(storage)


def behind_roots(remote: Storage, local: Storage) -> dict[str, int]:
    """For each checkpoint root of the bucket ``remote`` (:func:`checkpoint_roots`), its
    newest step when ``local``'s twin has none that new (:func:`behind`)."""
    out: dict[str, int] = {}
    for rel in checkpoint_roots(remote):
        step = behind(_sub(remote, rel), _sub(local, rel)) if rel else behind(remote, local)
        if step is not None:
            out[rel] = step
    return out


class TierUploader:
    """A thread that copies each step newly committed in ``local`` to ``remote`` (the
    newest one only, when it falls behind: a step superseded before its upload is
    skipped), for every checkpoint root under ``local`` (:func:`checkpoint_roots`, found
    again each round) to its twin under ``remote``, and calls ``on_commit`` with its
    :class:`TierCommit` (``tier``: the twin's URL), or ``on_error`` with a one-line
    reason (the next step tries again). ``retention``: the bucket's own, applied to a
    root after each of its uploads (None: the bucket keeps every step); it never deletes
    a root's newest step, a step newer than the last upload (another writer's in
    flight), nor the ``protect`` steps (one a restore is reading from the bucket). A DDP
    rank's part (``per-rank/rank<N>``) goes up with the top root's step (before its
    manifest, no event of its own) while the top root has steps, on its own otherwise
    (replica groups' parts); its retention keeps every step the bucket's other roots hold."""

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        on_commit: Callable[[TierCommit], None],
        on_error: Callable[[str], None],
        interval_s: float = 0.5,
        retention: RetentionPolicy | None = None,
        protect: Collection[int] = (),
    ) -> None:
        self.local, self.remote = local, remote
        self.retention, self.protect = retention, frozenset(protect)
        self.on_commit, self.on_error = on_commit, on_error
        self.interval_s = interval_s
        self._uploaded: dict[str, int | None] = {}  # per root: its newest step in the bucket
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-tier-upload", daemon=True)

    @property
    def uploaded(self) -> int | None:
        """The newest step of the top root in the bucket (None: none yet)."""
        return self._uploaded.get("")

    def start(self) -> TierUploader:
        self._seen("", self.remote)
        self._thread.start()
        return self

    def _seen(self, rel: str, remote: Storage) -> int | None:
        if rel not in self._uploaded:
            self._uploaded[rel] = None
            with contextlib.suppress(CheckpointError, OSError):
                steps = committed_steps(remote)
                self._uploaded[rel] = steps[-1] if steps else None
        return self._uploaded[rel]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.upload_newest()
            self._stop.wait(self.interval_s)
        self.upload_newest()  # what the job committed last, before it ended

    def upload_newest(self) -> None:
        """One round: each root's newest local step, where the bucket lacks it."""
        try:
            roots = checkpoint_roots(self.local)
        except (CheckpointError, OSError) as err:
            self.on_error(f"{type(err).__name__}: {err}".splitlines()[0])
            return
        with contextlib.suppress(CheckpointError, OSError):
            if committed_steps(self.local):  # DDP parts go up with the top root's steps
                roots = [r for r in roots if not r.startswith(f"{NESTED_ROOTS}/")]
        for rel in roots:
            local = _sub(self.local, rel) if rel else self.local
            remote = _sub(self.remote, rel) if rel else self.remote
            self._upload_root(rel, local, remote)

    def _upload_root(self, rel: str, local: Storage, remote: Storage) -> None:
        try:
            steps = committed_steps(local)
            last = self._seen(rel, remote)
            if not steps or (last is not None and steps[-1] <= last):
                return
            step = steps[-1]
            t0 = time.perf_counter()
            src = pin_step(local, step) if isinstance(local, LocalStorage) else local
            committed = load_manifest(src, step).created_unix
            there = remote.exists(manifest_path(step))  # a DDP part: with its root's step
            nbytes = copy_step(src, remote, step)
            seconds = time.perf_counter() - t0
            self._uploaded[rel] = step
            if not there:
                lag = max(0.0, time.time() - committed)
                self.on_commit(TierCommit(remote.url, step, seconds, lag, nbytes))
            if self.retention is not None:  # the bucket's own retention
                collect_garbage(remote, self.retention, protect=self._protected(rel))
        except (CheckpointNotFoundError, FileNotFoundError):
            return  # deleted locally before it was pinned: the next round takes a newer one
        except (CheckpointError, OSError, EOFError) as err:
            self.on_error(f"{type(err).__name__}: {err}".splitlines()[0])
        finally:
            if isinstance(local, LocalStorage):
                shutil.rmtree(os.path.join(local.root, STAGING), ignore_errors=True)

    def _protected(self, rel: str) -> frozenset[int]:
        if not rel.startswith(f"{NESTED_ROOTS}/"):
            return self.protect
        held: set[int] = set()
        for other in self._uploaded:
            if not other.startswith(f"{NESTED_ROOTS}/"):
                held |= set(committed_steps(_sub(self.remote, other) if other else self.remote))
        return self.protect | held

    def close(self) -> None:
        """Upload what is committed locally and not yet in the bucket, then stop."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
