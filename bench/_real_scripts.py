"""bench/recovery.py ``--only real`` and ``--only warm-overhead``: real-style scripts.

``real_scripts``: the RTO of one kill -9 of rank 1 (of 4 workers) at step 50, per route,
in the same run: ``torchrun`` (the unported script under torchrun ``--max-restarts 3``,
recovering by its own save/resume: the minimal job's torch.save every 20 steps, minGPT's
epoch snapshot, torchtitan's DCP checkpoint every 20 steps; the kill is struck here, when
rank 0's trace shows step 50), ``flash``, ``spare`` (a pre-forked spare) and ``warm``
(``--strategy spare --spares 1 --standby``: spares past the script's set-up), for the
minimal job (bench/_recovery_job.py), a script importing transformers
(bench/_hf_job.py) and the corpus's torchtitan-style, minGPT-style and HF Trainer scripts
(their own modules, such as ``_record`` and ``_mingpt``, preloaded:
agent/processes/_local_preload.py). Ratios: each route against flash, each script against the
minimal job, and flash against torchrun per script.

``warm_overhead``: what parked standbys cost while nothing fails: the steady step time
(after 20 warm-up steps) of fault-free runs under torchrun, flash and warm.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from _recovery_base import (
    JOB,
    VENV_BIN,
    _env,
    _median,
    _read_log,
    _run,
    recovery_figures,
    run_torchrun,
    steady_step_s,
)

from stalwart.chaos.proctree import descendants

HERE = Path(__file__).resolve().parent
HF_JOB = HERE / "_hf_job.py"  # imports transformers (pip install '.[bench]')
CORPUS = HERE.parent / "examples" / "corpus"
# name -> (corpus script, its flag for the number of steps, its torchrun arguments or
# None where it has no unported mode with its own resume)
CORPUS_JOBS: dict[str, tuple[str, str, list[str] | None]] = {
    "titan": ("titan_fsdp.py", "--steps", ["--plain", "--checkpoint_interval", "20"]),
    "mingpt": ("mingpt_ddp.py", "--steps", ["--plain"]),
    "trainer": ("hf_trainer.py", "--max_steps", None),  # an HF Trainer script (issue 29)
}
KILL = "kill rank=1 at=step:50"
ROUTES = ("torchrun", "flash", "spare", "warm")


def _run_job(
    work: Path,
    job: Path,
    job_args: list[str],
    strategy: str,
    chaos: str,
    timeout: float,
    corpus: bool = False,
) -> tuple[int, Path]:
    """``job`` under `stalwart run` (4 workers; ``chaos`` may be empty); a corpus script
    writes its trace under ``--out`` instead of a ``--step-log``."""
    log = work / "corpus" / "trace-m0.jsonl" if corpus else work / "steps.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "stalwart.cli.main",
        "run",
        "--nproc-per-node",
        "4",
        "--rdzv-id",
        f"bench-{uuid.uuid4().hex[:6]}",
        "--run-dir",
        str(work / "run"),
        "--strategy",
        "spare" if strategy == "warm" else strategy,
        *(["--standby"] if strategy == "warm" else []),  # spares past the set-up
        "--redirect",
        *(["--chaos", chaos] if chaos else []),
        *(["--spares", "1"] if strategy in ("spare", "warm") else []),
        str(job),
        *job_args,
        *(["--out", str(work / "corpus")] if corpus else ["--step-log", str(log)]),
    ]
    return _run(cmd, work, timeout, _env()), log


def _rank_pid(root: int, rank: int) -> int | None:
    """The worker of ``rank`` among the launcher's descendants (its RANK variable)."""
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def _reached(log: Path, step: int) -> bool:
    return any(int(r.get("step", 0)) >= step for r in _read_log(log))


def torchrun_corpus(
    work: Path, script: Path, job_args: list[str], timeout: float, kill_step: int = 50
) -> tuple[int, Path, float | None]:
    """The unported corpus script under torchrun ``--max-restarts 3``; rank 1 is killed
    (SIGKILL) once rank 0's trace shows ``kill_step``. Returns rc, rank 0's trace and the
    time of the kill (None: the run ended first)."""
    out = work / "corpus"
    log = out / "trace-m0.jsonl"
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "4"]
    cmd += ["--max-restarts", "3", str(script), *job_args, "--out", str(out)]
    t_fault: float | None = None
    deadline = time.monotonic() + timeout
    with open(work / "launcher.log", "w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=work, env=_env(), stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        while proc.poll() is None and time.monotonic() < deadline:
            if t_fault is None and _reached(log, kill_step):
                pid = _rank_pid(proc.pid, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    t_fault = time.time()
            time.sleep(0.02)  # a bench's poll of rank 0's trace, not a test's wait
        if proc.poll() is None:
            tree = descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        rc = proc.wait()
    return rc, log, t_fault


def _jobs(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """name -> (script, its arguments, corpus?, its torchrun arguments or None)."""
    steps = ["--steps", str(args.steps)]
    jobs: dict[str, Any] = {
        "minimal": (JOB, ["--mode", "stalwart", *steps], False, []),
    }
    try:
        import transformers  # noqa: F401

        jobs["hf"] = (HF_JOB, steps, False, None)
    except ImportError:
        result["real_note"] = "transformers is not installed: pip install '.[bench]'"
    for name, (script, flag, plain) in CORPUS_JOBS.items():
        if name == "trainer" and "hf" not in jobs:
            continue  # transformers is not installed (said above)
        if (CORPUS / script).exists():
            jobs[name] = (CORPUS / script, [flag, str(args.steps)], True, plain)
        else:
            result[f"{name}_note"] = f"examples/corpus/{script} does not exist"
    if args.jobs:
        jobs = {k: v for k, v in jobs.items() if k in args.jobs.split(",")}
    return jobs


def _one(
    args: argparse.Namespace, work: Path, name: str, job: Any, route: str
) -> dict[str, float | None] | None:
    script, job_args, corpus, plain = job
    if route != "torchrun":
        rc, log = _run_job(work, script, job_args, route, KILL, args.timeout, corpus)
        fig = recovery_figures(work, log)
    elif plain is None:
        return None  # no unported mode with its own resume
    elif name == "minimal":
        rc, log = run_torchrun(work, args.steps, "kill", args.timeout)
        fig = recovery_figures(work, log)
    else:
        rc, log, t_fault = torchrun_corpus(work, script, [*job_args, *plain], args.timeout)
        fig = recovery_figures(work, log, t_fault=t_fault) if t_fault else {}
    print(f"{route} {name:<8} rc={rc} rto_s={fig.get('rto_s')} lost={fig.get('steps_lost')}")
    return {**fig, "rc": rc}


def real_scripts(args: argparse.Namespace, root: Path, result: dict[str, Any]) -> None:
    """The RTO of each job under each route (module docstring), ``args.reps`` paired
    repetitions (every route of every job in each), medians and ratios."""
    jobs = _jobs(args, result)
    routes = [r for r in ROUTES if r in args.strategies.split(",")]
    figs: dict[tuple[str, str], list[dict[str, float | None]]] = {}
    for rep in range(args.reps):
        for name, job in jobs.items():
            for route in routes:
                work = root / f"real-{route}-{name}-{rep}"
                work.mkdir()
                fig = _one(args, work, name, job, route)
                if fig is not None:
                    figs.setdefault((route, name), []).append(fig)
    for (route, name), runs in figs.items():
        rtos = [f.get("rto_s") for f in runs]
        result[f"{route}_rto_s_{name}"] = _median(rtos)
        result[f"{route}_rto_s_{name}_all"] = rtos
        result[f"{route}_steps_lost_{name}"] = _median([f.get("steps_lost") for f in runs])
    for name in jobs:
        flash = result.get(f"flash_rto_s_{name}")
        for route in ("spare", "warm"):
            mine = result.get(f"{route}_rto_s_{name}")
            result[f"{route}_vs_flash_{name}"] = mine / flash if mine and flash else None
        plain = result.get(f"torchrun_rto_s_{name}")
        result[f"flash_vs_torchrun_{name}"] = flash / plain if flash and plain else None
        if name == "minimal":
            continue
        for route in ("flash", "spare", "warm"):
            mine, minimal = (
                result.get(f"{route}_rto_s_{name}"),
                result.get(f"{route}_rto_s_minimal"),
            )
            result[f"{route}_{name}_vs_minimal"] = mine / minimal if mine and minimal else None


def warm_overhead(args: argparse.Namespace, root: Path, result: dict[str, Any]) -> None:
    """Fault-free steady step time under torchrun, flash and warm (module docstring), for
    the minimal job and the minGPT-style script, ``args.reps`` paired repetitions."""
    jobs = {k: v for k, v in _jobs(args, result).items() if k in ("minimal", "mingpt")}
    steps = args.steps + 60
    for name, (script, job_args, corpus, plain) in jobs.items():
        job_args = [a if a != str(args.steps) else str(steps) for a in job_args]
        per: dict[str, list[float | None]] = {"torchrun": [], "flash": [], "warm": []}
        for rep in range(args.reps):
            for route in per:
                work = root / f"steady-{route}-{name}-{rep}"
                work.mkdir()
                if route != "torchrun":
                    _, log = _run_job(work, script, job_args, route, "", args.timeout, corpus)
                elif name == "minimal":
                    _, log = run_torchrun(work, steps, "", args.timeout)
                else:
                    _, log, _ = torchrun_corpus(
                        work, script, [*job_args, *plain], args.timeout, kill_step=10**9
                    )
                per[route].append(steady_step_s(log))
                print(f"steady {route} {name:<8} step_s={per[route][-1]}")
        for route, vals in per.items():
            result[f"steady_step_s_{route}_{name}"] = _median(vals)
        warm = per["warm"]
        result[f"warm_vs_flash_step_{name}_all"] = [
            w / f if w and f else None for w, f in zip(warm, per["flash"], strict=True)
        ]
        result[f"warm_vs_torchrun_step_{name}_all"] = [
            w / t if w and t else None for w, t in zip(warm, per["torchrun"], strict=True)
        ]
