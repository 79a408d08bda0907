"""Soak benchmark (issue 13): a 2-node job under random faults for ``--minutes``. Not in CI.

Two `stalwart run` agents on loopback (node 0 hosts the job's store, one worker per node
by default) train bench/_soak_job.py (a small DDP model, 6 MB of state, deterministic)
with ``--strategy`` (default ``flash``: docs/recovery.md's best node-loss recovery, with
``--standby`` and ``--replica-rate``) and ``--persist-every``, while this process injects
faults one at a time, drawn from ``random.Random(--seed)`` (the first four are one of each
kind, in a drawn order, so that a short soak covers every kind):

  kill       ``stalwart chaos RUN_DIR kill rank=R`` (SIGKILL of the worker, by its agent)
  hang       ``... hang rank=R`` (SIGSTOP: only the agent's hang detection finds it)
  slow       ``... slow rank=R factor=F for=Ds`` (a SIGSTOP/SIGCONT duty cycle: a rank that
             is slow, or behind a slow connection; nothing must be recovered)
  node_loss  node 1's agent, zygote, workers and standby SIGKILLed at once from outside
             (its process group, as a machine losing power); node 0 adopts its rank. The
             node is then brought back the only way a fixed-size job takes a node back
             (a returning agent is refused: docs/etcd.md, docs/recovery.md "Limits"): node
             0 is stopped (SIGTERM) and both agents are started again with the same
             command, which resumes from the newest committed checkpoint in RUN_DIR/ckpt.
             (Node 0 hosts the store: losing it ends the job, so only node 1 is lost.)

One line per fault: the time since the soak's start, the fault, its target, and when
training went on (the first step rank 0 completed in a later generation, or after the
relaunch), with the steps redone. The next fault waits for ``--mean-gap`` seconds on
average (exponential, at least 2 s) and for ``--min-steps`` new steps.

At the end: every committed checkpoint (RUN_DIR/ckpt and every per-rank part) passes
``stalwart ckpt verify --all``; nothing of the job is left in /dev/shm (checked after
every stop of the job, before anything removes it); the final parameters and optimizer
state equal (sha256) those of a fault-free run of the same job (same seed and steps, run
afterwards with ``--step-ms 0``: the per-step sleep changes no state). flash, spare and
restart promise bit-identity (docs/recovery.md, docs/porting.md); the output says so.
The last line is JSON: faults injected / survived per kind, steps redone, checkpoints
verified, /dev/shm leftovers, the parameter verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _soak_faults import (
    KINDS,
    FailureBudget,
    Fault,
    FaultResult,
    StepLog,
    draw_faults,
    parse_weights,
)
from _two_nodes import STALWART, TwoNodes, events, free_port, job_shm, remove_job_shm

from stalwart.coordinator import CoordinatorConfig

HERE = Path(__file__).resolve().parent
JOB = HERE / "_soak_job.py"
BIT_IDENTICAL = {"flash", "spare", "restart"}  # docs/recovery.md, docs/porting.md


class Soak:
    """One soak: the job, its faults, their results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(tempfile.mkdtemp(prefix="stalwart-soak-"))
        self.job = f"soak-{uuid.uuid4().hex[:6]}"
        self.run_dir = self.root / "run"
        self.log = StepLog(self.root / "steps.jsonl")
        self.port = free_port()
        self.results: list[FaultResult] = []
        self.leftovers: list[str] = []
        self.segments = 0
        iso = CoordinatorConfig(job_id=self.job)  # the isolation policy stalwart run uses
        world = 2 * args.nproc_per_node
        self.budget = FailureBudget(
            iso.failure_threshold, iso.failure_window, args.nproc_per_node, world
        )
        self.t0 = time.time()
        self.nodes = self._nodes(self.run_dir, "soak", args.step_ms, self.log.path, "out")

    # ---------------------------------------------------------------- the job
    def _nodes(self, run_dir: Path, tag: str, step_ms: float, log: Path, out: str) -> TwoNodes:
        a = self.args
        launch = ["--nproc-per-node", str(a.nproc_per_node), "--strategy", a.strategy]
        launch += ["--persist-every", str(a.persist_every), "--keep-last", str(a.keep_last)]
        launch += ["--snapshot-every", str(a.snapshot_every), "--node-lease", str(a.node_lease)]
        if a.strategy in ("flash", "spare"):
            launch += ["--standby", "--replica-rate", str(a.replica_rate)]
        script = [str(JOB), "--steps", str(a.steps), "--seed", str(a.seed)]
        script += ["--step-ms", str(step_ms), "--step-log", str(log)]
        script += ["--out", str(self.root / out)]
        job = self.job if tag == "soak" else f"{self.job}-ref"
        rdzv = ["--rdzv-id", job, "--rdzv-endpoint", f"127.0.0.1:{self.port}"]
        if tag != "soak":
            rdzv[-1] = f"127.0.0.1:{free_port()}"
        return TwoNodes(job, run_dir, self.root, tag, rdzv, launch, script)

    def say(self, text: str, at: float | None = None) -> None:
        """A line stamped with seconds since the soak's start (``at``: that moment)."""
        print(f"[{time.time() - self.t0 if at is None else at:7.1f} s] {text}", flush=True)

    def check_shm(self, when: str) -> None:
        """After the job stopped: nothing of it may be left in /dev/shm."""
        left = [p.name for p in job_shm(self.job)]
        if left:
            self.leftovers += left
            self.say(f"LEFT IN /dev/shm after {when}: {left}")
            remove_job_shm(self.job)

    def launch(self) -> None:
        self.segments += 1
        self.nodes.start_all()

    def running(self) -> bool:
        return all(self.nodes.alive(n) for n in (0, 1))

    # ---------------------------------------------------------------- faults
    def inject(self, fault: Fault) -> FaultResult:
        before = self.log.last()
        t = time.time()
        step, gen = (before["step"], before["gen"]) if before else (0, 0)
        res = FaultResult(t - self.t0, fault, step, gen)
        if fault.kind == "node_loss":
            self.nodes.kill(1)
        else:
            from stalwart.cli.chaos import queue_faults

            queue_faults(str(self.run_dir), fault.spec())
        if fault.kind == "slow":
            self._watch_slow(res, t, fault)
        else:
            self._wait_recovery(res, t, gen)
        res.detected_s = self._detected(t, fault)  # before a relaunch rotates events.jsonl
        if fault.kind == "node_loss" and res.survived:
            self._bring_back(res)
        return res

    def _wait_recovery(self, res: FaultResult, t: float, gen: int) -> None:
        """Training went on: rank 0 completed a step in a later generation."""
        deadline = time.time() + self.args.recovery_timeout
        while time.time() < deadline and self.nodes.alive(0):
            after = self.log.first_after(t, lambda e: e["gen"] > gen)
            if after is not None:
                res.recovered(after["t"] - t, after["step"])
                return
            time.sleep(0.05)
        res.note = "no step in a later generation"
        if not self.nodes.alive(0):
            res.note += f" (node 0's agent exited {self.nodes.procs[0].returncode})"

    def _watch_slow(self, res: FaultResult, t: float, fault: Fault) -> None:
        """Nothing to recover: the job must keep stepping through it and after it."""
        assert fault.seconds is not None
        time.sleep(fault.seconds)
        during = [e for e in self.log.entries() if t <= e["t"] < t + fault.seconds]
        deadline = time.time() + self.args.recovery_timeout
        while time.time() < deadline and self.nodes.alive(0):
            after = self.log.first_after(t + fault.seconds, lambda e: True)
            if after is not None:
                res.recovered(after["t"] - t - fault.seconds, after["step"])
                res.note = f"{len(during)} steps while slowed"
                if any(e["gen"] != res.gen_before for e in [*during, after]):
                    res.note += " (a recovery happened: the slow rank was taken for failed)"
                return
            time.sleep(0.05)
        res.note = "no step after the slow period"

    def _bring_back(self, res: FaultResult) -> None:
        """Node 1 back: stop node 0 (SIGTERM), start both again; the job resumes from
        the newest committed checkpoint."""
        time.sleep(self.args.single_node_s)  # trains on one node meanwhile
        last = self.log.last()
        proc = self.nodes.procs[0]
        proc.terminate()
        proc.wait(60)
        self.check_shm("node 0 stopped (SIGTERM) to bring node 1 back")
        t = time.time()
        self.launch()
        deadline = t + self.args.recovery_timeout + 60
        while time.time() < deadline and self.running():
            after = self.log.first_after(t, lambda e: True)
            if after is not None:
                redone = (last["step"] if last else 0) - after["step"] + 1
                res.back_s, res.back_redone = after["t"] - t, max(0, redone)
                res.resumed_at = after["step"] - 1
                return
            time.sleep(0.1)
        res.survived = False
        res.note = "the relaunched job did not train"

    def _detected(self, t: float, fault: Fault) -> float | None:
        """The first ``fault_detected`` after ``t``: its latency as the agent measured it
        from the fault it fired, or for a node killed from outside (no fired record;
        the agent counts from the end of the watched connection), from the kill."""
        for e in events(self.run_dir):
            if e.get("kind") == "fault_detected" and float(e["t"]) >= t:
                outside = fault.kind == "node_loss"
                return float(e["t"]) - t if outside else float(e["latency_s"])
        return None

    def loop(self) -> None:
        a = self.args
        end = self.t0 + a.minutes * 60
        faults = draw_faults(self.rng, a.nproc_per_node * 2, a.weights, self.budget)
        while True:
            self._pause(max(2.0, self.rng.expovariate(1 / a.mean_gap)))
            if time.time() + 5 > end or not self.running():
                return
            last = self.log.last()
            if last is not None and last["step"] > a.steps * 0.9:
                self.say("the job is near its last step: no more faults")
                return
            self.budget.update(events(self.run_dir))  # drawn from the job's own count
            res = self.inject(next(faults))
            self.results.append(res)
            self.say(res.line(), at=res.t)
            if not res.survived:
                return

    def _pause(self, gap: float) -> None:
        """``gap`` seconds and ``--min-steps`` completed steps before the next fault;
        then the failure count is read (the next fault is drawn from it)."""
        t, start = time.time(), self.log.last()
        target = (start["step"] if start else 0) + self.args.min_steps
        while self.running():
            last = self.log.last()
            if time.time() - t >= gap and last is not None and last["step"] >= target:
                return
            time.sleep(0.1)

    # ---------------------------------------------------------------- the end
    def finish(self) -> list[int | None]:
        """Let the job run to its last step; the agents' exit codes."""
        self.say(f"no more faults; the job runs to step {self.args.steps}")
        codes = self.nodes.wait(self.args.steps * (self.args.step_ms / 1000 + 0.2) + 120)
        if None in codes:
            self.say(f"the job did not end in time (exit codes {codes}); stopping it")
            self.nodes.stop()
        self.check_shm("the job's end")
        return codes

    def verify_checkpoints(self) -> dict[str, Any]:
        """`stalwart ckpt verify --all` on every checkpoint directory of the run."""
        ckpt = self.run_dir / "ckpt"
        dirs = [ckpt, *sorted(p for p in (ckpt / "per-rank").glob("rank*") if p.is_dir())]
        out: dict[str, Any] = {"dirs": 0, "steps": 0, "failed": [], "per_dir": {}}
        for d in dirs:
            if not d.exists():
                continue
            cmd = [STALWART, "ckpt", "verify", "--all", "--json", str(d)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            out["dirs"] += 1
            try:
                doc = json.loads(r.stdout)
            except ValueError:
                doc = None
            if r.returncode != 0 or doc is None:
                err = (r.stderr or r.stdout).strip().splitlines()
                out["failed"].append(
                    f"{d.relative_to(self.run_dir)}: {err[-1] if err else r.returncode}"
                )
                continue
            ok, bad = _verified_steps(doc)
            out["steps"] += ok
            name = str(d.relative_to(self.run_dir))
            out["per_dir"][name] = ok
            out["failed"] += [f"{name} step {b}" for b in bad]
        return out

    def reference(self) -> str | None:
        """The digest of a fault-free run of the same job (no per-step sleep)."""
        ref = self._nodes(self.root / "ref-run", "ref", 0.0, self.root / "ref.steps", "ref.out")
        try:
            ref.start_all()
            codes = ref.wait(self.args.steps * 0.2 + 300)
        finally:
            left = ref.stop()
        if left:
            self.say(f"the fault-free run left {len(left)} entries in /dev/shm")
        path = self.root / "ref.out"
        if codes != [0, 0] or not path.exists():
            self.say(
                f"the fault-free run failed (exit codes {codes}); see {self.root}/ref.node*.err"
            )
            return None
        return path.read_text().strip()


def _verified_steps(doc: Any) -> tuple[int, list[int]]:
    """(steps verified ok, steps not ok) of a `ckpt verify --all --json` answer."""
    steps = doc.get("steps") if isinstance(doc, dict) else None
    if not isinstance(steps, list):
        return 0, []
    bad = [int(s.get("step", -1)) for s in steps if not s.get("ok")]
    return len(steps) - len(bad), bad


def reported_steps_lost(run_dir: Path) -> int:
    """The ``steps_lost`` of every ``recovery_end`` (the runtime's own count), over this
    run and the runs the relaunches rotated into RUN_DIR/prev/."""
    dirs = [run_dir, *sorted((run_dir / "prev").glob("*"))]
    ends = [e for d in dirs for e in events(d) if e.get("kind") == "recovery_end"]
    return sum(int(e.get("steps_lost") or 0) for e in ends)


def summarize(
    soak: Soak, codes: list[int | None], ckpt: dict[str, Any], ref: str | None
) -> dict[str, Any]:
    a, res = soak.args, soak.results
    got_path = soak.root / "out"
    got = got_path.read_text().strip() if got_path.exists() else None
    by_kind = {k: sum(1 for r in res if r.fault.kind == k) for k in KINDS}
    ok_kind = {k: sum(1 for r in res if r.fault.kind == k and r.survived) for k in by_kind}
    promised = a.strategy in BIT_IDENTICAL
    same = got is not None and got == ref
    return {
        "minutes": a.minutes,
        "wall_s": round(time.time() - soak.t0, 1),
        "strategy": a.strategy,
        "seed": a.seed,
        "steps": a.steps,
        "faults_injected": len(res),
        "faults_survived": sum(1 for r in res if r.survived),
        "injected_by_kind": by_kind,
        "survived_by_kind": ok_kind,
        "steps_redone": soak.log.redone(),
        "steps_lost_reported": reported_steps_lost(soak.run_dir),
        "job_finished": codes == [0, 0],
        "relaunches": soak.segments - 1,
        "checkpoint_dirs_verified": ckpt["dirs"],
        "checkpoints_verified": ckpt["steps"],
        "checkpoints_per_dir": ckpt["per_dir"],
        "checkpoints_failed": ckpt["failed"],
        "shm_leftovers": soak.leftovers,
        "params_equal_fault_free": same,
        "bit_identity_promised": promised,
        "params_sha256": got,
        "reference_sha256": ref,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "faults": [r.as_json() for r in res],
    }


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0, help="how long faults are injected")
    p.add_argument("--seed", type=int, default=0, help="the faults' RNG and the job's data")
    p.add_argument("--strategy", default="flash", help="flash | spare | restart")
    p.add_argument("--persist-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--replica-rate", type=float, default=50.0, help="MB/s (flash, spare)")
    p.add_argument("--node-lease", type=float, default=3.0)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--step-ms", type=float, default=100.0, help="sleep per step")
    p.add_argument("--steps", type=int, default=0, help="default: what --minutes covers")
    p.add_argument("--mean-gap", type=float, default=10.0, help="seconds between faults")
    p.add_argument("--min-steps", type=int, default=30, help="steps between faults")
    p.add_argument("--single-node-s", type=float, default=3.0, help="after a node loss")
    p.add_argument("--recovery-timeout", type=float, default=120.0)
    p.add_argument("--weights", default="kill=4,hang=3,slow=3,node_loss=1")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    args = p.parse_args()
    if args.strategy not in BIT_IDENTICAL:
        p.error(
            f"--strategy {args.strategy}: the soak runs a fixed-size job; use flash, spare or "
            "restart (elastic resizes the group: bench/elastic.py measures it)"
        )
    try:
        args.weights = parse_weights(args.weights)
    except ValueError as err:
        p.error(str(err))
    if args.steps <= 0:  # the fault window, then a short tail without faults
        # ~50 ms of compute, allreduce and snapshots per step on a loaded 2-core VM
        args.steps = int((args.minutes * 60 + 30) / (args.step_ms / 1000 + 0.05))
    return args


def print_summary(out: dict[str, Any]) -> None:
    verdict = "BIT-IDENTICAL" if out["params_equal_fault_free"] else "DIFFERENT"
    if out["params_sha256"] is None:
        verdict = "NOT COMPARED (the job did not finish, so it has no final state)"
    promise = "promised by" if out["bit_identity_promised"] else "not promised by"
    lines = [
        f"faults survived: {out['faults_survived']} of {out['faults_injected']} "
        f"(injected {out['injected_by_kind']}, survived {out['survived_by_kind']})",
        f"steps redone: {out['steps_redone']} (rank 0's completed steps done again; the "
        f"runtime's recovery_end steps_lost sum to {out['steps_lost_reported']})",
        f"committed checkpoints verified: {out['checkpoints_verified']} "
        f"{out['checkpoints_per_dir']}; failed: {out['checkpoints_failed'] or 'none'}",
        f"left in /dev/shm: {out['shm_leftovers'] or 'nothing'}",
        f"final parameters and optimizer state: {verdict} to the fault-free run's "
        f"({promise} --strategy {out['strategy']}: docs/recovery.md)",
    ]
    print("\n".join(lines), flush=True)


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # the agents run in their own sessions: stop them


def main() -> int:
    args = _args()
    signal.signal(signal.SIGTERM, _terminated)
    soak = Soak(args)
    print(
        f"soak: 2 nodes x {args.nproc_per_node} worker(s), --strategy {args.strategy}, "
        f"{args.steps} steps, faults for {args.minutes:g} min, seed {args.seed}; "
        f"run dir {soak.run_dir}",
        flush=True,
    )
    try:
        soak.launch()
        if soak.log.wait_steps(5, lambda: soak.running(), 300):
            soak.say("training; injecting faults")
            soak.loop()
        codes = soak.finish()
    finally:
        soak.nodes.stop()
    soak.say("verifying the checkpoints; running the fault-free reference")
    ckpt = soak.verify_checkpoints()
    ref = soak.reference() if codes == [0, 0] else None  # nothing to compare otherwise
    out = summarize(soak, codes, ckpt, ref)
    print_summary(out)
    good = (
        out["job_finished"]
        and out["faults_survived"] == out["faults_injected"]
        and not out["checkpoints_failed"]
        and not out["shm_leftovers"]
        and out["params_equal_fault_free"]
    )
    if good and not args.keep:
        shutil.rmtree(soak.root, ignore_errors=True)
    else:
        print(f"run directory and agents' stderr kept in {soak.root}", flush=True)
    print(json.dumps(out), flush=True)
    return 0 if good else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
