"""The background persister: a process that imports no torch.

It reads a complete shared-memory slot by name, writes it to storage (pack, index,
and for the committer the manifest and GC), and answers on stdout. Why a process and not
a thread: the training process keeps its GIL and cores for training, a crash of the
persister cannot take training down, and without torch it starts in ~50 ms (DCP's
writer process takes seconds). It runs at a lower CPU priority than training.

It ends with the training process that started it: a Ctrl-C reaches the whole process
group, but the persister ignores SIGINT (its parent ends it: the ``exit`` request, or the
end of stdin) and leaves at once with ``os._exit`` when its parent is gone (a worker the
agent killed). It runs niced, so on a loaded machine an interrupted interpreter's teardown
took it tens of seconds, holding the launcher's stderr open after the job had ended; a
persist cut short that way is a kill -9 mid-save, which the commit protocol survives
(the manifest is written last).

Protocol: one JSON object per line on stdin, one reply per line on stdout.
``{"op": "persist", "id", "storage", "slot_dir", "slot", "rank", "world_size",
"commit", "chunk_bytes", "keep_last", "keep_every", "generation", "s3"}`` (``s3``: an
S3Config as a dict, or null; optionally
``"only": [names]``: write only those top-level entries of the slot) ->
``{"id", "ok": true, "step", "written_bytes", "total_bytes", "seconds", "committed"}``
(plus ``"skipped": "committed"`` when the step was already committed: nothing written) or
``{"id", "ok": false, "kind": "<error class>", "error": "<one line>"}``.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import sys
import threading
import time
from typing import Any

from stalwart.checkpoint._select import select
from stalwart.checkpoint._shm import SlotFiles
from stalwart.checkpoint._writer import known_chunks, write_rank
from stalwart.checkpoint.catalog import committed_steps, load_index, load_manifest
from stalwart.checkpoint.commit import StepCommitter
from stalwart.checkpoint.format import ChunkRef, manifest_path
from stalwart.checkpoint.retention import RetentionPolicy
from stalwart.checkpoint.storage import Storage, open_storage
from stalwart.errors import CheckpointError

__all__ = ["handle_persist", "main"]


class _DedupBase:
    """Chunks of the newest committed step, refreshed when a newer one appears."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.known: dict[str, ChunkRef] = {}

    def get(self, storage: Storage) -> dict[str, ChunkRef]:
        steps = committed_steps(storage)
        newest = steps[-1] if steps else None
        if newest != self.step:
            try:
                manifest = load_manifest(storage, newest) if newest is not None else None
                self.known = known_chunks(storage, manifest)
            except (CheckpointError, OSError):
                self.known = {}  # a damaged base only costs deduplication
            self.step = newest
        return dict(self.known)


_BASES: dict[str, _DedupBase] = {}


class _SlotMaps:
    """Read mappings of slot files, kept open between persists.

    Mapping 1.5 GB afresh costs page faults on first touch and a page-table teardown
    on close (~0.1 s together here) for every persist; a slot file is reused until the
    snapshotter grows it, which replaces the file (new inode) and so the mapping."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int], mmap.mmap]] = {}

    def view(self, path: str) -> memoryview:
        st = os.stat(path)
        ident = (st.st_ino, st.st_size)
        cached = self._maps.get(path)
        if cached is None or cached[0] != ident:
            if cached is not None:
                with contextlib.suppress(BufferError):
                    cached[1].close()
            fd = os.open(path, os.O_RDONLY)
            try:
                mapping = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[path] = (ident, mapping)
        return memoryview(self._maps[path][1])


_MAPS = _SlotMaps()


_STORAGES: dict[str, Storage] = {}


def _open(req: dict[str, Any]) -> Storage:
    """The storage of a request, kept between persists (an S3 client and its pool of
    connections are worth reusing); ``s3``: the manager's S3Config, as a dict."""
    url, options = str(req["storage"]), req.get("s3")
    key = json.dumps([url, options], sort_keys=True)
    if key not in _STORAGES:
        from stalwart.checkpoint.storage import S3Config

        s3 = S3Config(**options) if isinstance(options, dict) else None
        _STORAGES[key] = open_storage(url, s3=s3)
    return _STORAGES[key]


def handle_persist(req: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    cpu0 = os.times()
    storage = _open(req)
    slot = SlotFiles(str(req["slot_dir"]), int(req["slot"]))
    meta = slot.read_meta()
    if meta is None:
        raise CheckpointError(f"snapshot slot {slot.meta_path} is not complete; snapshot again")
    if storage.exists(manifest_path(meta.step)):
        return _already_committed(storage, meta.step, int(req["rank"]), t0)
    base = _BASES.setdefault(storage.url, _DedupBase())
    tree, layout = meta.tree, meta.layout
    only = req.get("only")
    if only is not None:
        tree, layout = select(tree, layout, [str(n) for n in only])
    data = _MAPS.view(slot.data_path)
    try:
        result = write_rank(
            storage,
            step=meta.step,
            rank=int(req["rank"]),
            world_size=int(req["world_size"]),
            tree=tree,
            layout=layout,
            data=data,
            known=base.get(storage),
            chunk_bytes=int(req.get("chunk_bytes", 4 << 20)),
            copy_of=None if req.get("copy_of") is None else int(req["copy_of"]),
        )
    finally:
        with contextlib.suppress(BufferError):  # a traceback may still hold slices
            data.release()
    reply: dict[str, Any] = {
        "ok": True,
        "step": meta.step,
        "written_bytes": result.written_bytes,
        "total_bytes": result.index.nbytes,
        "committed": False,
        "write_s": time.perf_counter() - t0,  # pack + rank index, durable
    }
    if req.get("commit"):  # alone: no coordinator to fence it (else the trainer commits)
        t_commit = time.perf_counter()
        committer = StepCommitter(
            storage,
            world_size=int(req["world_size"]),
            replicated=bool(req.get("replicated", False)),
            retention=RetentionPolicy(
                int(req.get("keep_last", RetentionPolicy.keep_last)), req.get("keep_every")
            ),
        )
        done = committer.commit(meta.step, generation=int(req.get("generation", 0)))
        reply["committed"] = True
        reply["commit_s"] = time.perf_counter() - t_commit
        assert done.gc is not None
        reply["gc_deleted_steps"] = done.gc.deleted_steps
        reply["gc_freed_bytes"] = done.gc.freed_bytes
    reply["seconds"] = time.perf_counter() - t0
    cpu1 = os.times()
    reply["cpu_s"] = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return reply


def _already_committed(storage: Storage, step: int, rank: int, t0: float) -> dict[str, Any]:
    """The reply to a persist of a step that is already committed (after a restart from
    an older step, the job trains through it again): nothing is written, the committed
    step stays as it is (docs/checkpoint-format.md, "A committed step is immutable")."""
    manifest = load_manifest(storage, step)
    total = load_index(storage, manifest, rank).nbytes if rank < manifest.world_size else 0
    return {
        "ok": True,
        "step": step,
        "written_bytes": 0,
        "total_bytes": total,
        "committed": True,
        "skipped": "committed",
        "write_s": 0.0,
        "seconds": time.perf_counter() - t0,
        "cpu_s": 0.0,
    }


def _send(doc: dict[str, Any]) -> bool:
    """Write one line to the parent; False when it is gone (its end of the pipe closed:
    a worker killed, a job torn down). Nobody waits for the reply then, so the persister
    exits quietly: a BrokenPipeError traceback in the job's log would read as a fault of
    its own. stdout is pointed at /dev/null first, or the interpreter's final flush of
    the unwritten line prints "Exception ignored ... BrokenPipeError" on the way out."""
    try:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return False
    return True


def _die_with_parent(parent: int) -> None:
    """Leave at once (no teardown) when ``parent`` is gone: polled, as the parent may
    have started this process from any thread (``PR_SET_PDEATHSIG`` follows the thread)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, name="stalwart-persist-parent", daemon=True).start()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends this process
    _die_with_parent(os.getppid())
    nice = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if nice:
        os.nice(nice)
    if not _send({"ready": True, "pid": os.getpid()}):
        return 0
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "exit":
            break
        try:
            reply = handle_persist(req)
        except Exception as err:  # every failure is reported, the worker stays up
            reply = {"ok": False, "kind": type(err).__name__, "error": str(err)}
        reply["id"] = req.get("id")
        if not _send(reply):
            return 0  # the parent died: nothing left to answer
    return 0


if __name__ == "__main__":
    code = main()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(code)  # no interpreter teardown at a niced pace: nothing is left to do
