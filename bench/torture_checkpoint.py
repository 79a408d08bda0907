#!/usr/bin/env python3
"""Crash-consistency torture for the checkpoint engine: SIGKILL the persister, then check.

The driver starts a child process (this file with ``--child``; it imports no torch, so it
starts in ~0.15 s) that saves step after step, forever, continuing from the newest
committed step + 1. Each step it builds a deterministic state for every rank in a
shared-memory slot and calls :func:`stalwart.checkpoint._persist_worker.handle_persist`
exactly as the persister process does (the last rank commits, then GC runs with
``keep_last=2``, so garbage collection deletes steps and shared packs all the time).

The driver SIGKILLs the child at a random instant, reaps it, and checks the storage:

- the newest committed step verifies (``verify_step``, deep), and ``restore_state`` loads
  it (not an older one) with every rank's bytes equal to the recomputed expected content;
- every other visible committed step verifies and restores bit-exactly as well
  ("committed and verifiable, or invisible");
- no committed step goes backwards: a step seen committed may only vanish when at least
  ``keep_last`` newer committed steps exist (retention). (Each kill inside a GC may
  leave one more old step behind; the next complete GC removes it, see below.)

Kill instants, three kinds, shuffled so that every 10 instants hold 4 ``uniform`` ones and
one of each aimed kind per phase:

- ``uniform``: the driver kills at a uniform time over a window of a few steps after the
  child is ready;
- ``delay``: aimed at a phase (rank write, commit, GC), which the child reports on stdout
  as it starts: the driver kills a random fraction of that phase's typical duration after
  its n-th start;
- ``op``: the child SIGKILLs itself just before its k-th storage mutation (file create,
  write, rename, atomic write, delete) inside the n-th run of a phase, so a crash between
  any two file operations of a commit or a GC is hit, not only the instants a timer can
  reach (a commit or a GC takes about a millisecond here).

The phase that was really interrupted is the last one the child reported before it died.

State: per rank, ``{"blob": uint8[rank_bytes], "extra": float32[3000], "info": {...}}``.
Chunk ``i`` of the blob changes every ``i % 4 + 1`` steps, so later steps reference
chunks of packs written by earlier ones, and a pack dies only when all its chunks have
changed: GC of shared packs is exercised. ``extra`` changes every step, at a slot offset
that is not chunk-aligned.

After the last instant, a few clean steps run and the storage must hold nothing that no
committed step references (no pack, temp file or step directory leaked by a crash).

Usage: ``python bench/torture_checkpoint.py [--instants 200] [--seed 0]``; the last line
of output is JSON: ``{"instants", "failures", "committed_steps_seen", "seconds", ...}``.
Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import itertools
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import IO, Any

KEEP_LAST = 2
EXTRA_ELEMS = 3000  # float32 leaf that changes every step
PHASES = ("start", "fill", "write", "commit", "gc")
AIMED = ("write", "commit", "gc")
MODES = ("uniform", "delay", "op")
START_TIMEOUT_S = 60.0  # a child that is not ready by then is reported (loaded machine)
EVENT_TIMEOUT_S = 60.0  # an aimed-at phase that never starts is reported


@dataclass(frozen=True)
class TortureConfig:
    instants: int = 200
    seed: int = 0
    ranks: int = 2
    rank_bytes: int = (3 << 20) // 2 + 4321  # ~3 MB per step; last chunk is partial
    chunk_bytes: int = 64 << 10
    root: str | None = None  # checkpoint directory; a fresh temp dir by default
    keep_root: bool = False
    clean_steps: int = KEEP_LAST + 1  # after the last kill: then nothing may be left over
    inject_bug: str | None = None  # break the engine on purpose (tests of the harness)


# --------------------------------------------------------------------------- content


def chunk_period(i: int) -> int:
    return i % 4 + 1


@functools.lru_cache(maxsize=512)
def _chunk(seed: int, rank: int, i: int, version: int, length: int) -> bytes:
    return hashlib.shake_128(f"stalwart-torture:{seed}:{rank}:{i}:{version}".encode()).digest(
        length
    )


def expected_blob(seed: int, step: int, rank: int, nbytes: int, chunk_bytes: int) -> bytes:
    """The blob of ``rank`` at ``step``: chunk ``i`` changes every ``i % 4 + 1`` steps."""
    parts = []
    for i, start in enumerate(range(0, nbytes, chunk_bytes)):
        length = min(chunk_bytes, nbytes - start)
        parts.append(_chunk(seed, rank, i, step // chunk_period(i), length))
    return b"".join(parts)


def expected_extra(seed: int, step: int, rank: int) -> bytes:
    return _chunk(seed, rank, -1, step, EXTRA_ELEMS * 4)


def expected_info(step: int, rank: int) -> dict[str, int]:
    return {"step": step, "rank": rank}


def _extra_offset(rank_bytes: int) -> int:
    return (rank_bytes + 63) // 64 * 64


def slot_tree_and_layout(step: int, rank: int, rank_bytes: int) -> tuple[Any, list[Any], int]:
    """What the snapshotter would record for ``{"blob", "extra", "info"}`` (tagged JSON
    tree, tensor layout in the slot, slot size), built without torch."""
    tree = {
        "t": "dict",
        "items": [
            ["blob", {"t": "tensor", "id": 0}],
            ["extra", {"t": "tensor", "id": 1}],
            ["info", {"t": "dict", "items": [["step", step], ["rank", rank]]}],
        ],
    }
    off = _extra_offset(rank_bytes)
    layout = [
        {"id": 0, "path": ".blob", "dtype": "uint8", "shape": [rank_bytes]},
        {"id": 1, "path": ".extra", "dtype": "float32", "shape": [EXTRA_ELEMS]},
    ]
    layout[0].update(nbytes=rank_bytes, offset=0, shard=None, ndarray=False)
    layout[1].update(nbytes=EXTRA_ELEMS * 4, offset=off, shard=None, ndarray=False)
    return tree, layout, off + EXTRA_ELEMS * 4


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
    from stalwart.checkpoint import _persist_worker as pw
    from stalwart.checkpoint.storage.local import LocalStorage

    for owner, name, kind in (
        (pw, "commit_step", "commit"),
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
    from stalwart.checkpoint import _persist_worker as pw
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
    from stalwart.checkpoint._shm import SlotFiles, SlotMeta
    from stalwart.checkpoint.catalog import committed_steps
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


# --------------------------------------------------------------------------- the checker


@dataclass
class Tracker:
    """What the checker has seen so far: steps must never go backwards."""

    last: list[int] = field(default_factory=list)  # committed steps at the previous check
    seen: set[int] = field(default_factory=set)  # every step ever seen committed


def check_storage(root: str, cfg: TortureConfig, tracker: Tracker) -> list[str]:
    """Every problem with the checkpoint directory after a kill (empty: all good)."""
    import torch

    from stalwart.checkpoint.catalog import committed_steps, verify_step
    from stalwart.checkpoint.restore import restore_state
    from stalwart.checkpoint.storage import open_storage
    from stalwart.errors import StalwartError

    storage = open_storage(root)
    problems: list[str] = []
    steps = committed_steps(storage)
    if tracker.last and not steps:
        problems.append(f"every committed step vanished (had {tracker.last})")
    if steps and tracker.last and steps[-1] < tracker.last[-1]:
        problems.append(f"newest committed step went backwards: {tracker.last[-1]} -> {steps[-1]}")
    for s in tracker.last:
        newer = [t for t in steps if t > s]
        if s not in steps and len(newer) < KEEP_LAST:
            problems.append(
                f"committed step {s} vanished with only {len(newer)} newer committed steps "
                f"(retention keeps the newest {KEEP_LAST})"
            )

    for s in steps:
        report = verify_step(storage, s, deep=True)
        if not report.ok:
            problems.extend(f"verify step {s}: {p}" for p in report.problems)

    def load(rank: int, step: int | None) -> tuple[int, list[str], dict[str, Any]]:
        state: dict[str, Any] = {
            "blob": torch.zeros(cfg.rank_bytes, dtype=torch.uint8),
            "extra": torch.zeros(EXTRA_ELEMS, dtype=torch.float32),
            "info": {},
        }
        res = restore_state(storage, state, rank=rank, world_size=cfg.ranks, step=step)
        return res.step, res.skipped, state

    for rank in range(cfg.ranks):
        for s in reversed(steps):
            latest = s == steps[-1]
            try:
                got, skipped, state = load(rank, None if latest else s)
            except StalwartError as err:
                problems.append(f"restore step {s} rank {rank}: {type(err).__name__}: {err}")
                continue
            if got != s or skipped:
                problems.append(
                    f"restore of the latest (step {s}) rank {rank} loaded step {got}"
                    + (f", skipping: {'; '.join(skipped[:3])}" if skipped else "")
                )
                continue
            blob = state["blob"].numpy().tobytes()
            want = expected_blob(cfg.seed, s, rank, cfg.rank_bytes, cfg.chunk_bytes)
            if blob != want:
                bad = next(i for i in range(len(want)) if blob[i] != want[i])
                problems.append(
                    f"restore step {s} rank {rank}: blob differs from the saved state "
                    f"(first at byte {bad}, chunk {bad // cfg.chunk_bytes})"
                )
            if state["extra"].view(torch.uint8).numpy().tobytes() != expected_extra(
                cfg.seed, s, rank
            ):
                problems.append(f"restore step {s} rank {rank}: 'extra' differs")
            if state["info"] != expected_info(s, rank):
                problems.append(f"restore step {s} rank {rank}: info {state['info']}")
    tracker.last = steps
    tracker.seen.update(steps)
    return problems


def leftovers(root: str) -> list[str]:
    """Files no committed step references (call after clean steps ran to their GC)."""
    from stalwart.checkpoint.catalog import committed_steps, load_manifest
    from stalwart.checkpoint.format import MANIFEST_NAME, index_path, parse_step_dir
    from stalwart.checkpoint.storage import open_storage

    storage = open_storage(root)
    steps = committed_steps(storage)
    wanted: set[str] = set()
    for s in steps:
        m = load_manifest(storage, s)
        wanted.update(m.packs)
        wanted.update(index_path(s, r) for r in range(m.world_size))
        wanted.add(f"step_{s:012d}/{MANIFEST_NAME}")
    present: set[str] = set()
    for name in storage.listdir(""):
        if name == "data" or parse_step_dir(name) is not None:
            present.update(f"{name}/{f}" for f in storage.listdir(name))
            if parse_step_dir(name) is not None and not storage.listdir(name):
                present.add(f"{name}/")
        else:
            present.add(name)
    return sorted(present - wanted)


# --------------------------------------------------------------------------- the driver


@dataclass
class PhaseStats:
    """Typical durations (seconds) and storage mutation counts of the child's phases,
    learned from its phase reports."""

    seconds: dict[str, float] = field(
        default_factory=lambda: {"step": 0.05, "write": 0.004, "commit": 0.001, "gc": 0.001}
    )
    mutations: dict[str, int] = field(default_factory=lambda: dict.fromkeys(AIMED, 8))

    def learn(self, events: list[dict[str, Any]]) -> None:
        for a, b in itertools.pairwise(events):
            if a["e"] in AIMED:
                self._add(a["e"], b["t"] - a["t"])
                self.mutations[a["e"]] = max(self.mutations[a["e"]], int(b.get("ops", 0)))
        done = [e["t"] for e in events if e["e"] == "done"]
        for a_t, b_t in itertools.pairwise(done):
            self._add("step", b_t - a_t)

    def _add(self, key: str, value: float) -> None:
        self.seconds[key] = 0.8 * self.seconds[key] + 0.2 * max(value, 0.0)


@dataclass
class KillPlan:
    """``uniform``: the driver kills ``delay_s`` after the child is ready (a window of a
    few steps). ``delay``: the driver kills ``delay_s`` after the ``nth`` start of
    ``phase`` (a fraction of its typical duration). ``op``: the child kills itself just
    before its ``op``-th storage mutation in the ``nth`` run of ``phase``."""

    mode: str
    phase: str = ""
    nth: int = 1
    delay_s: float = 0.0
    op: int = 0

    def describe(self) -> str:
        if self.mode == "uniform":
            return f"uniform +{self.delay_s * 1e3:.1f} ms"
        if self.mode == "delay":
            return f"{self.phase} #{self.nth} +{self.delay_s * 1e3:.2f} ms"
        return f"{self.phase} #{self.nth} before mutation {self.op}"


_DECK = [("uniform", "")] * 4 + [(m, ph) for m in ("delay", "op") for ph in AIMED]
"""Every 10 instants: 4 uniform, and one kill of each aimed kind at each phase, shuffled;
so even a short run kills inside commit and GC."""


class KillPlanner:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._deck: list[tuple[str, str]] = []

    def next(self, stats: PhaseStats, ranks: int) -> KillPlan:
        rng = self.rng
        if not self._deck:
            self._deck = list(_DECK)
            rng.shuffle(self._deck)
        mode, phase = self._deck.pop()
        if mode == "uniform":
            return KillPlan("uniform", delay_s=rng.uniform(0.0, 4.0 * stats.seconds["step"]))
        nth = rng.randint(1, 2 * ranks) if phase == "write" else rng.randint(1, 2)
        if mode == "delay":
            return KillPlan("delay", phase, nth, delay_s=rng.uniform(0.0, stats.seconds[phase]))
        return KillPlan("op", phase, nth, op=rng.randint(0, stats.mutations[phase]))


def _child_cmd(
    cfg: TortureConfig,
    root: str,
    shm_dir: str,
    max_steps: int | None,
    plan: KillPlan | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--root",
        root,
        "--shm-dir",
        shm_dir,
        "--ranks",
        str(cfg.ranks),
        "--rank-bytes",
        str(cfg.rank_bytes),
        "--chunk-bytes",
        str(cfg.chunk_bytes),
        "--seed",
        str(cfg.seed),
    ]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    if cfg.inject_bug:
        cmd += ["--inject-bug", cfg.inject_bug]
    if plan is not None and plan.mode == "op":
        cmd += ["--die-in", plan.phase, "--die-nth", str(plan.nth), "--die-op", str(plan.op)]
    return cmd


class _Child:
    """One child process, its phase reports, and its stderr in a file."""

    def __init__(self, cmd: list[str], stderr_path: str) -> None:
        self._stderr_path = stderr_path
        with open(stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err
            )
        assert self.proc.stdout is not None
        self._out: IO[bytes] = self.proc.stdout
        self._buf = b""
        self.events: list[dict[str, Any]] = []
        self.eof = False

    def read(self, timeout: float) -> list[dict[str, Any]]:
        """Phase reports that arrive within ``timeout`` seconds (empty at EOF)."""
        if self.eof:
            return []
        ready, _, _ = select.select([self._out], [], [], max(timeout, 0.0))
        if not ready:
            return []
        data = os.read(self._out.fileno(), 1 << 16)
        if not data:
            self.eof = True
            return []
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        new = []
        for line in lines:
            with contextlib.suppress(ValueError):  # anything else on stdout is not a report
                ev = json.loads(line)
                if isinstance(ev, dict) and "e" in ev:
                    new.append(ev)
        self.events.extend(new)
        return new

    def kill_and_reap(self) -> int:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        rc = self.proc.wait(timeout=30)
        deadline = time.monotonic() + 10.0
        while not self.eof and time.monotonic() < deadline:  # what it reported before dying
            self.read(deadline - time.monotonic())
        self._out.close()
        return rc

    def stderr_tail(self, n: int = 1500) -> str:
        try:
            with open(self._stderr_path, "rb") as f:
                return f.read().decode(errors="replace")[-n:].strip()
        except OSError:
            return ""


def kill_once(
    cfg: TortureConfig, root: str, shm_dir: str, plan: KillPlan, stderr_path: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """Start a child, SIGKILL it as planned, reap it. Returns its reports and problems."""
    child = _Child(_child_cmd(cfg, root, shm_dir, None, plan), stderr_path)
    problems: list[str] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S  # until ready, then until the kill
        kill_at: float | None = None
        starts = 0
        while not child.eof:
            now = time.monotonic()
            if kill_at is not None and now >= kill_at:
                break
            if now >= deadline:
                problems.append(
                    f"child never reached the planned kill point ({plan.describe()}) in time"
                )
                break
            for ev in child.read(min(deadline, kill_at or deadline) - now):
                if ev["e"] == "ready":
                    deadline = time.monotonic() + EVENT_TIMEOUT_S
                    if plan.mode == "uniform":
                        kill_at = time.monotonic() + plan.delay_s
                elif plan.mode == "delay" and ev["e"] == plan.phase:
                    starts += 1
                    if starts == plan.nth:
                        kill_at = time.monotonic() + plan.delay_s
    finally:
        rc = child.kill_and_reap()
    if rc != -signal.SIGKILL:
        problems.append(f"child exited by itself (status {rc}): {child.stderr_tail()}")
    return child.events, problems


def run_clean_steps(cfg: TortureConfig, root: str, shm_dir: str, steps: int, work: str) -> str:
    """Run ``steps`` steps without a kill; returns "" or a problem."""
    child = _Child(_child_cmd(cfg, root, shm_dir, steps), os.path.join(work, "clean.err"))
    deadline = time.monotonic() + START_TIMEOUT_S + 30.0 * steps
    try:
        while not child.eof and time.monotonic() < deadline:
            child.read(deadline - time.monotonic())
        if child.eof:  # it closed its stdout: let it exit on its own
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        rc = child.kill_and_reap()  # kills only one still running past the deadline
    if rc != 0:
        return f"clean run of {steps} steps failed (status {rc}): {child.stderr_tail()}"
    return ""


def save_steps(cfg: TortureConfig, root: str, steps: int) -> str:
    """Save ``steps`` steps into ``root`` without a kill (own temp dirs, removed after).
    Returns "" or a problem."""
    work = tempfile.mkdtemp(prefix="stalwart-torture-")
    shm_dir = tempfile.mkdtemp(prefix="stalwart-torture-", dir="/dev/shm")
    try:
        return run_clean_steps(cfg, root, shm_dir, steps, work)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class Summary:
    instants: int
    failures: int
    committed_steps_seen: int
    newest_step: int | None
    seconds: float
    kills_by_phase: dict[str, int]
    kills_by_mode: dict[str, int]
    leaked_files: int
    child_imported_torch: bool
    failed: list[dict[str, Any]]


class _Progress:
    def __init__(self, stream: IO[str], total: int) -> None:
        self.stream = stream
        self.total = total
        self.tty = stream.isatty()
        self.every = max(1, total // 10)

    def update(self, done: int, failures: int, newest: int | None, phases: Counter[str]) -> None:
        kills = " ".join(f"{p}:{phases[p]}" for p in PHASES if phases[p])
        line = f"[{done:>4}/{self.total}] failures {failures} | newest step {newest} | {kills}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif done % self.every == 0 or done == self.total:
            self.stream.write(line + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()


def run_torture(
    cfg: TortureConfig,
    *,
    progress: IO[str] | None = None,
    before_check: Callable[[str, int], None] | None = None,
) -> Summary:
    """Kill the persisting child ``cfg.instants`` times, checking the storage after each.

    ``before_check(root, instant)`` runs after each kill and before its check (tests use
    it to damage the storage and prove that the checker notices)."""
    t0 = time.monotonic()
    planner = KillPlanner(random.Random(cfg.seed))
    work = tempfile.mkdtemp(prefix="stalwart-torture-")
    shm_dir = tempfile.mkdtemp(prefix="stalwart-torture-", dir="/dev/shm")
    root = cfg.root or os.path.join(work, "ckpt")
    stats = PhaseStats()
    tracker = Tracker()
    phases: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    failed: list[dict[str, Any]] = []
    child_torch = False
    leaked: list[str] = []
    prog = _Progress(progress, cfg.instants) if progress is not None else None
    try:
        for i in range(1, cfg.instants + 1):
            plan = planner.next(stats, cfg.ranks)
            events, problems = kill_once(cfg, root, shm_dir, plan, os.path.join(work, "child.err"))
            stats.learn(events)
            last: dict[str, Any] = events[-1] if events else {"e": "start", "step": -1}
            phase = {"ready": "start", "done": "fill"}.get(str(last["e"]), str(last["e"]))
            phases[phase] += 1
            modes[plan.mode] += 1
            if plan.mode == "op" and phase != plan.phase and not problems:
                problems.append(f"harness: self-kill ({plan.describe()}) landed in {phase}")
            child_torch |= any(e.get("torch") for e in events if e["e"] == "ready")
            if before_check is not None:
                before_check(root, i)
            problems += check_storage(root, cfg, tracker)
            if problems:
                failed.append(
                    {
                        "instant": i,
                        "phase": phase,
                        "step": last["step"],
                        "plan": plan.describe(),
                        "problems": problems,
                    }
                )
                if prog is not None:
                    prog.message(
                        f"FAIL instant {i}: killed in {phase} of step {last['step']} "
                        f"({plan.describe()}): " + " | ".join(problems[:4])
                    )
            if prog is not None:
                prog.update(i, len(failed), tracker.last[-1] if tracker.last else None, phases)
        problem = run_clean_steps(cfg, root, shm_dir, cfg.clean_steps, work)
        if problem:
            failed.append({"instant": "clean", "phase": "-", "step": -1, "problems": [problem]})
        else:
            leaked = leftovers(root)
            final = check_storage(root, cfg, tracker)
            if final:
                failed.append({"instant": "clean", "phase": "-", "step": -1, "problems": final})
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        if not cfg.keep_root:
            shutil.rmtree(work, ignore_errors=True)
    if prog is not None:
        if leaked:
            prog.message(f"leaked after clean steps: {', '.join(leaked[:10])}")
        if cfg.keep_root:
            prog.message(f"checkpoint directory kept: {root}")
    return Summary(
        instants=cfg.instants,
        failures=len(failed),
        committed_steps_seen=len(tracker.seen),
        newest_step=tracker.last[-1] if tracker.last else None,
        seconds=round(time.monotonic() - t0, 2),
        kills_by_phase={p: phases[p] for p in PHASES},
        kills_by_mode={m: modes[m] for m in MODES},
        leaked_files=len(leaked),
        child_imported_torch=child_torch,
        failed=failed[:20],
    )


def format_summary(s: Summary, cfg: TortureConfig) -> str:
    kills = ", ".join(f"{p} {n}" for p, n in s.kills_by_phase.items())
    modes = ", ".join(f"{m} {n}" for m, n in s.kills_by_mode.items())
    return "\n".join(
        [
            f"torture: {s.instants} kill instants, {s.failures} failures, {s.seconds:.1f} s",
            f"  killed in: {kills}",
            f"  kill modes: {modes}",
            f"  committed steps seen: {s.committed_steps_seen} (newest {s.newest_step}); "
            f"{cfg.ranks} ranks x {cfg.rank_bytes / 2**20:.2f} MiB, "
            f"{cfg.chunk_bytes >> 10} KiB chunks, keep_last={KEEP_LAST}",
            f"  after {cfg.clean_steps} clean steps: {s.leaked_files} leaked files",
        ]
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="SIGKILL the checkpoint persister at random instants (save, commit, "
        "GC) and check after each kill that the latest committed checkpoint verifies and "
        "restores bit-exactly."
    )
    p.add_argument("--instants", type=_positive, default=200, help="kills (default 200)")
    p.add_argument("--seed", type=int, default=0, help="random seed (kill plan and content)")
    p.add_argument("--ranks", type=_positive, default=2, help="ranks per step (default 2)")
    p.add_argument("--rank-bytes", type=_positive, default=TortureConfig.rank_bytes)
    p.add_argument("--chunk-bytes", type=_positive, default=TortureConfig.chunk_bytes)
    p.add_argument("--root", help="checkpoint directory (default: a fresh temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    p.add_argument(
        "--inject-bug",
        choices=INJECTABLE_BUGS,
        help="break the engine on purpose, to see the torture catch it",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shm-dir", help=argparse.SUPPRESS)
    p.add_argument("--max-steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--die-in", choices=AIMED, help=argparse.SUPPRESS)
    p.add_argument("--die-nth", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--die-op", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.root and os.path.exists(args.root) and os.listdir(args.root):
        p.error(f"--root {args.root} is not empty; pass a new directory")
    cfg = TortureConfig(
        instants=args.instants,
        seed=args.seed,
        ranks=args.ranks,
        rank_bytes=args.rank_bytes,
        chunk_bytes=args.chunk_bytes,
        root=args.root,
        keep_root=args.keep,
        inject_bug=args.inject_bug,
    )
    summary = run_torture(cfg, progress=sys.stderr)
    for f in summary.failed:
        print(f"FAILED instant {f['instant']} ({f['phase']}, step {f['step']}):")
        for problem in f["problems"][:10]:
            print(f"    {problem}")
    print(format_summary(summary, cfg))
    out = asdict(summary)
    del out["failed"]
    print(json.dumps(out))
    return 1 if summary.failures or summary.leaked_files or summary.child_imported_torch else 0


if __name__ == "__main__":
    sys.exit(main())
