"""The child process: saves step after step until it is killed (or kills itself)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from _torture.content import (
    EXTRA_ELEMS,
    KEEP_LAST,
    expected_blob,
    expected_extra,
    slot_tree_and_layout,
)

# --------------------------------------------------------------------------- the child


class _ChildPhase:
    """The child's current phase, how often it started, and its storage mutations so far.

    With a self-kill plan (``--die-in PHASE --die-nth N --die-op K``) the child SIGKILLs
    itself just before the K-th storage mutation of the N-th run of PHASE, or at the end
    of that run if it has fewer mutations: a crash between any two file operations."""

    def __init__(self, die: tuple[str, int, int] | None) -> None:
        self.name = "start"
        self.starts: Counter[str] = Counter()
        self.ops = 0
        self.die = die

    def _targeted(self) -> bool:
        return (
            self.die is not None
            and self.name == self.die[0]
            and self.starts[self.name] == self.die[1]
        )

    def before_mutation(self) -> None:
        if self._targeted() and self.die is not None and self.ops == self.die[2]:
            os.kill(os.getpid(), signal.SIGKILL)
        self.ops += 1

    def enter(self, name: str) -> int:
        """Start phase ``name``; returns the mutations of the phase that ended."""
        if self._targeted():
            os.kill(os.getpid(), signal.SIGKILL)  # it had fewer mutations than planned
        ended, self.ops = self.ops, 0
        self.name = name
        self.starts[name] += 1
        return ended


class _CountedStream:
    def __init__(self, inner: Any, phase: _ChildPhase) -> None:
        self._inner = inner
        self._phase = phase

    def write(self, data: memoryview | bytes) -> None:
        self._phase.before_mutation()
        self._inner.write(data)

    def commit(self) -> None:
        self._phase.before_mutation()
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


def _reporting(
    original: Callable[..., Any], kind: str, emit: Callable[[str], None]
) -> Callable[..., Any]:
    def observed(*a: Any, **k: Any) -> Any:
        emit(kind)
        return original(*a, **k)

    return observed


def _counting(original: Callable[..., Any], phase: _ChildPhase, stream: bool) -> Callable[..., Any]:
    def observed(*a: Any, **k: Any) -> Any:
        phase.before_mutation()
        result = original(*a, **k)
        return _CountedStream(result, phase) if stream else result

    return observed


def _observe_child(phase: _ChildPhase, emit: Callable[[str], None]) -> str:
    """Report commit and GC as they start, and count storage mutations (for self-kills).
    Only observes: every call goes on to the engine's own function. "" or a problem."""
    from stalwart.checkpoint import commit as pw  # the commit path the persister runs
    from stalwart.checkpoint.storage.local import LocalStorage

    for owner, name, kind in (
        (pw, "publish_step", "commit"),
        (pw, "collect_garbage", "gc"),
        (LocalStorage, "write_atomic", ""),
        (LocalStorage, "delete", ""),
        (LocalStorage, "delete_dir", ""),
        (LocalStorage, "open_stream", ""),
    ):
        original = getattr(owner, name, None)
        if not callable(original):
            return (
                f"{owner.__name__} has no {name}() to observe; update "
                "bench/torture_checkpoint.py to the engine's new structure"
            )
        if kind:
            observed = _reporting(original, kind, emit)
        elif name == "open_stream":
            observed = _counting(original, phase, stream=True)
        else:
            observed = _counting(original, phase, stream=False)
        setattr(owner, name, observed)
    return ""


INJECTABLE_BUGS = ("gc-manifest-last",)


def _inject_bug(name: str) -> None:
    """Break the engine on purpose (tests of this harness use it: they prove that the kill
    instants reach inside a GC and that the checks then fail). ``gc-manifest-last``: GC
    removes a step's manifest after its other files instead of first, so a kill in
    between leaves a visible step with missing files."""
    from stalwart.checkpoint import commit as pw  # the commit path the persister runs
    from stalwart.checkpoint.format import MANIFEST_NAME
    from stalwart.checkpoint.storage.local import LocalStorage

    assert name == "gc-manifest-last", name
    gc, delete = getattr(pw, "collect_garbage"), LocalStorage.delete  # noqa: B009
    deferred: list[tuple[Any, str]] = []
    in_gc = [False]

    def late_delete(self: Any, path: str) -> None:
        if in_gc[0] and path.endswith("/" + MANIFEST_NAME):
            deferred.append((self, path))
        else:
            delete(self, path)

    def late_gc(*a: Any, **k: Any) -> Any:
        in_gc[0] = True
        try:
            return gc(*a, **k)
        finally:
            in_gc[0] = False
            for storage, path in dict.fromkeys(deferred):
                delete(storage, path)
            deferred.clear()

    LocalStorage.delete = late_delete  # type: ignore[method-assign]
    setattr(pw, "collect_garbage", late_gc)  # noqa: B010


def child_main(args: argparse.Namespace) -> int:
    """Save steps forever (or ``--max-steps``), reporting each phase on stdout. No torch."""
    from stalwart.checkpoint import _persist_worker as pw
    from stalwart.checkpoint.catalog import committed_steps
    from stalwart.checkpoint.slots import SlotFiles, SlotMeta
    from stalwart.checkpoint.storage import open_storage

    step = 0
    die = (args.die_in, args.die_nth, args.die_op) if args.die_in else None
    phase = _ChildPhase(die)

    def emit(kind: str, rank: int = -1, **extra: Any) -> None:
        ops = phase.enter(kind)
        line = {"e": kind, "step": step, "rank": rank, "t": time.monotonic(), "ops": ops}
        os.write(1, (json.dumps({**line, **extra}) + "\n").encode())

    problem = _observe_child(phase, emit)
    if problem:
        print(f"torture child: {problem}", file=sys.stderr)
        return 2
    if args.inject_bug:
        _inject_bug(args.inject_bug)
    storage = open_storage(args.root)
    steps = committed_steps(storage)
    step = steps[-1] + 1 if steps else 0
    emit("ready", torch="torch" in sys.modules)
    ranks, rank_bytes, chunk_bytes, seed = args.ranks, args.rank_bytes, args.chunk_bytes, args.seed
    slots = [SlotFiles(args.shm_dir, r) for r in range(ranks)]
    done = 0
    while args.max_steps is None or done < args.max_steps:
        for rank in range(ranks):
            emit("fill", rank)
            slot = slots[rank]
            tree, layout, size = slot_tree_and_layout(step, rank, rank_bytes)
            slot.invalidate()
            m = slot.map_writable(size)
            m[0:rank_bytes] = expected_blob(seed, step, rank, rank_bytes, chunk_bytes)
            off = layout[1]["offset"]
            m[off : off + EXTRA_ELEMS * 4] = expected_extra(seed, step, rank)
            slot.publish(SlotMeta(seq=step, step=step, tree=tree, layout=layout, data_size=size))
            emit("write", rank)
            request = {  # what CheckpointManager.persist sends to the persister process
                "op": "persist",
                "id": step * ranks + rank,
                "storage": args.root,
                "slot_dir": args.shm_dir,
                "slot": rank,
                "rank": rank,
                "world_size": ranks,
                "commit": rank == ranks - 1,
                "chunk_bytes": chunk_bytes,
                "keep_last": KEEP_LAST,
                "keep_every": None,
                "generation": 0,
                "replicated": False,
            }
            reply = pw.handle_persist(request)
            if reply.get("committed") != (rank == ranks - 1) or reply.get("step") != step:
                print(f"torture child: unexpected persist reply {reply}", file=sys.stderr)
                return 3
        emit("done")
        step += 1
        done += 1
    for slot in slots:
        slot.close()
    return 0
