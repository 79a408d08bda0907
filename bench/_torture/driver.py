"""The driver: plans kill instants, runs and kills children, checks, counts."""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass, field
from typing import IO, Any

from _torture.check import Tracker, check_storage, leftovers
from _torture.content import (
    AIMED,
    EVENT_TIMEOUT_S,
    KEEP_LAST,
    MODES,
    PHASES,
    START_TIMEOUT_S,
    TortureConfig,
)

# the children run the script itself with --child
_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torture_checkpoint.py"
)

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
        _SCRIPT,
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
