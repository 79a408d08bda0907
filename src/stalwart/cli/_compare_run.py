"""Running one route of ``stalwart compare``: the command, the faults, the observation.

A route is a launcher command (torchrun, ``stalwart run --strategy S``, or torchft's
lighthouse and replica groups: :mod:`stalwart.cli._torchft_launch`) over the same corpus
script; the fault trace reaches it as ``--chaos`` clauses at the trace's instants under
stalwart, and as signals sent by :class:`_Injector` under torchrun and torchft (which
have no chaos): the same instants, measured from the job's first step in both cases, on the
process that holds the trace's rank at that moment (read from the script's own step
records, ``pid``). Only processes below the launcher compare started are ever signalled.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from stalwart.chaos.proctree import descendants, die_with_parent, stop_tree
from stalwart.chaos.trace import FaultTrace, TraceFault
from stalwart.metrics.routes import (
    RouteRun,
    StepRecord,
    before_target,
    read_step_records,
    recoveries,
)

__all__ = ["Route", "RunSettings", "load_route", "run_route", "term_exits"]

_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}


@dataclass(frozen=True)
class Route:
    """One column of the table: how the job is launched and recovered."""

    name: str
    launcher: str  # "stalwart"; "torchrun" (--max-restarts + the script's torch.save); "torchft"
    strategy: str = ""  # stalwart's --strategy (empty for the others)
    spares: int = 0
    nproc: str = ""  # --nproc-per-node when not the worker count (elastic's MIN:MAX)
    extra_args: tuple[str, ...] = ()  # script arguments this route needs (elastic's data)
    launcher_args: tuple[str, ...] = ()  # `stalwart run` flags it needs (async's groups)

    @property
    def injected(self) -> bool:
        """Faults sent as signals by compare (the launcher has no fault injector)."""
        return self.launcher != "stalwart"


@dataclass(frozen=True)
class RunSettings:
    """What every route of one comparison shares."""

    script: Path
    script_args: tuple[str, ...]
    workers: int
    target: int
    work: Path
    timeout_s: float
    persist_every: int  # restart's --persist-every, and the torchrun script's save cadence
    cap: float = 3.0  # a faulted run is stopped at cap x its fault-free time: not reached


def _command(route: Route, st: RunSettings, out: Path, job: str, chaos: str) -> list[str]:
    script = [str(st.script), *st.script_args, *route.extra_args, "--out", str(out / "corpus")]
    if route.launcher == "torchrun":
        launcher = [str(Path(sys.executable).parent / "torchrun"), "--standalone"]
        launcher += ["--nproc-per-node", str(st.workers), "--max-restarts", "1000"]
        return [*launcher, *script]
    if route.launcher == "torchft":
        launcher = [sys.executable, "-m", "stalwart.cli._torchft_launch"]
        return [*launcher, "--workers", str(st.workers), "--", *script]
    cmd = [sys.executable, "-m", "stalwart.cli.main", "run", "--redirect", "--rdzv-id", job]
    cmd += ["--nproc-per-node", route.nproc or str(st.workers), "--run-dir", str(out / "run")]
    cmd += ["--strategy", route.strategy, "--max-restarts", "1000", "--blocklist-after", "1000"]
    cmd += ["--persist-every", str(st.persist_every)] if route.strategy == "restart" else []
    cmd += ["--spares", str(route.spares)] if route.spares else []
    cmd += ["--chaos", chaos] if chaos else []
    cmd += list(route.launcher_args)
    return [*cmd, *script]


def _last_pid(path: Path) -> int | None:
    if not path.exists():
        return None
    for line in reversed(path.read_text().splitlines()):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(json.loads(line)["pid"])
    return None


class _Injector(threading.Thread):
    """Sends the trace's signals to a torchrun or torchft job at the trace's instants (from
    its first step); a fault whose rank is between processes waits for the next one to
    step. None is sent once member 0 recorded the ``target`` step (the job's last)."""

    def __init__(
        self, corpus: Path, launcher: int, faults: tuple[TraceFault, ...], target: int
    ) -> None:
        super().__init__(daemon=True)
        self.corpus, self.launcher, self.faults = corpus, launcher, faults
        self.target = target
        self.fired: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = None
        while t0 is None and not self.stop.wait(0.2):
            recs = read_step_records(self.corpus / "trace-m0.jsonl")
            t0 = recs[0].t if recs else None
        for fault in self.faults:
            while t0 is not None and time.time() < t0 + fault.t_s:
                if self.stop.wait(min(0.2, t0 + fault.t_s - time.time())):
                    return
            while not self.stop.is_set() and not self._signal(fault):
                self.stop.wait(0.1)

    def _signal(self, fault: TraceFault) -> bool:
        recs = read_step_records(self.corpus / "trace-m0.jsonl")
        done = bool(recs) and max(r.step for r in recs) >= self.target
        if done or (self.corpus / "final-m0.json").exists():
            self.stop.set()  # member 0 is done: later instants are past the run's end
            return False
        pid = _last_pid(self.corpus / f"trace-m{fault.rank}.jsonl")
        if pid is None or pid not in descendants(self.launcher):
            return False  # between incarnations: strike the next one
        try:
            os.kill(pid, _SIGNALS[fault.kind])
        except ProcessLookupError:
            return False
        self.fired.append(time.time())
        return True


def _injected_at(run_dir: Path) -> tuple[float, ...]:
    """The instants stalwart's chaos fired its faults (``fault_injected`` events)."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return ()
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            e = json.loads(line)
            if e["kind"] == "fault_injected":
                out.append(float(e["t"]))
    return tuple(sorted(out))


class _Watcher(threading.Thread):
    """Prints a line per fault of a route as it is recovered (progress while it runs)."""

    def __init__(self, label: str, corpus: Path, faults: Callable[[], tuple[float, ...]]):
        super().__init__(daemon=True)
        self.label, self.corpus, self.faults = label, corpus, faults
        self.stop = threading.Event()
        self.said = 0

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.report()

    def report(self) -> None:
        recs = read_step_records(self.corpus / "trace-m0.jsonl")
        done = recoveries(recs, self.faults())
        t0 = recs[0].t if recs else 0.0
        while self.said < len(done) and done[self.said].rto_s is not None:
            r = done[self.said]
            self.said += 1
            print(
                f"  {self.label}: fault {self.said} at {r.t_fault - t0:.1f}s: resumed after "
                f"{r.rto_s:.2f}s, {r.steps_lost} steps lost",
                flush=True,
            )


def _reap(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = descendants(proc.pid)  # before the launcher dies and they are reparented
        for pid in [proc.pid, *tree]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return -9


@contextlib.contextmanager
def term_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) meanwhile (main thread only), so a terminated compare
    unwinds through :func:`_finish` and stops the route it is running, as Ctrl-C does."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _launch(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The route's launcher, in a session of its own (its process group is the route's)
    that dies with compare even when compare is SIGKILLed (PR_SET_PDEATHSIG)."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def _finish(proc: subprocess.Popen[bytes], timeout: float, grace_s: float = 10.0) -> int:
    """The launcher's exit status; on any way out of compare meanwhile (Ctrl-C, SIGTERM,
    an error) its whole tree is stopped first."""
    try:
        return _reap(proc, timeout)
    except BaseException:
        stop_tree(proc, grace_s)
        raise


def run_route(
    route: Route, st: RunSettings, trace: FaultTrace | None, label: str, timeout_s: float
) -> RouteRun:
    """Run ``route`` once (faulted when ``trace`` is given) and return what was observed."""
    out = st.work / label.replace("/", "-")
    out.mkdir(parents=True, exist_ok=True)
    job = f"cmp-{uuid.uuid4().hex[:8]}"
    faults = trace.faults if trace is not None else ()
    chaos = "" if route.injected or trace is None else trace.chaos_spec()
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    launched = time.time()
    proc = _launch(_command(route, st, out, job, chaos), out / "launcher.log", env)
    injector = _Injector(out / "corpus", proc.pid, faults, st.target) if route.injected else None
    fired: Callable[[], tuple[float, ...]] = (
        (lambda: tuple(injector.fired)) if injector else (lambda: _injected_at(out / "run"))
    )
    watcher = _Watcher(label, out / "corpus", fired)
    for thread in (injector, watcher):
        if thread is not None:
            thread.start()
    try:
        rc = _finish(proc, timeout_s)
    finally:
        for thread in (injector, watcher):
            if thread is not None:
                thread.stop.set()
    exited = time.time()
    for thread in (injector, watcher):
        if thread is not None:
            thread.stop.set()
            thread.join()
    watcher.report()
    for path in glob.glob(f"/dev/shm/stalwart-{job}-*"):  # a killed job's leftovers
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    observed = {"launched": launched, "exited": exited, "rc": rc, "faults_at": fired()}
    observed["fault_ranks"] = [f.rank for f in faults[: len(fired())]]
    (out / "observed.json").write_text(json.dumps(observed) + "\n")  # to re-read the run
    run = load_route(route, st, trace, label)
    if run is None:
        raise RuntimeError(f"compare: cannot read back {out / 'observed.json'} just written")
    return run


def _member_records(corpus: Path) -> tuple[tuple[StepRecord, ...], ...]:
    """Every member's step records (``trace-m<M>.jsonl``), by member."""
    paths = []
    for path in corpus.glob("trace-m*.jsonl"):
        with contextlib.suppress(ValueError):
            paths.append((int(path.stem.removeprefix("trace-m")), path))
    return tuple(read_step_records(path) for _, path in sorted(paths))


def load_route(
    route: Route, st: RunSettings, trace: FaultTrace | None, label: str
) -> RouteRun | None:
    """The run ``run_route`` left in ``label``'s folder (its ``observed.json`` and step
    records; ``trace`` the one it ran under, None for a fault-free run), or None when there
    is none or it cannot be read: ``compare --reuse``."""
    out = st.work / label.replace("/", "-")
    try:
        obs = json.loads((out / "observed.json").read_text())
        launched, exited, rc = float(obs["launched"]), float(obs["exited"]), int(obs["rc"])
        faults_at = tuple(float(t) for t in obs["faults_at"])
        struck = [f.rank for f in (trace.faults if trace else ())][: len(faults_at)]
        ranks = tuple(int(r) for r in obs.get("fault_ranks", struck))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (0 < launched <= exited):
        return None
    records = read_step_records(out / "corpus" / "trace-m0.jsonl")
    met = before_target(((r.step, r.t) for r in records), st.target, faults_at)
    return RouteRun(
        route=route.name,
        workers=st.workers,
        spares=route.spares,
        target=st.target,
        launched=launched,
        exited=exited,
        rc=rc,
        records=records,
        faults_at=faults_at[:met],  # a fault fired past the target step counts unfired
        member_records=_member_records(out / "corpus"),
        fault_ranks=ranks[:met],
        late_faults=len(faults_at) - met,
        planned_at=tuple(f.t_s for f in trace.faults) if trace is not None else (),
    )
