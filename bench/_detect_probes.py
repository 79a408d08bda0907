"""Health probes and the preflight node check, for bench/detection.py.

``preflight_s``: the wall time of ``stalwart run --preflight``'s paired check (the
``preflight`` events' ``seconds``) for 2 nodes x 2 workers on loopback; measured beside
the same job started without it, so that ``preflight_ratio_startup`` (preflight_s over
the plain job's start-up, ``run_start`` to its first step) says what it costs against
what a start costs anyway on the same machine at the same time (the workers fork from a
zygote that imported torch already), and ``preflight_ratio_import`` over one ``import
torch`` in a new process measured between the two runs: the check process imports torch,
which is most of what it costs. Also which verdicts the two nodes got (on one host they
should both be ``ok``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from _two_nodes import TwoNodes, events, free_port

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "examples" / "train_lm.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probes-steps", type=int, default=20, help="steps of the preflight job")


def _run(work: Path, tag: str, steps: int, extra: list[str]) -> list[dict[str, Any]]:
    job = f"bench-probes-{tag}-{uuid.uuid4().hex[:6]}"
    run_dir = work / tag
    rdzv = ["--rdzv-id", job, "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    launch = ["--nproc-per-node", "2", "--node-lease", "3", *extra]
    script = [str(SCRIPT), "--steps", str(steps), "--dim", "32", "--layers", "1"]
    nodes = TwoNodes(job, run_dir, work, tag, rdzv, launch, script)
    nodes.start_all()
    try:
        codes = nodes.wait(600)
    finally:
        nodes.stop()
    if codes != [0, 0]:
        raise RuntimeError(f"{tag}: agents ended with {codes}; see {work}/{tag}.node*.err")
    return events(run_dir)


def _startup_s(evs: list[dict[str, Any]]) -> float:
    start = min(e["t"] for e in evs if e["kind"] == "run_start")
    first = min(e["t_first_start"] for e in evs if e["kind"] == "steps")
    return float(first - start)


def _import_torch_s() -> float:
    """What one ``import torch`` in a new process costs now: the check's floor."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=600)
    return time.monotonic() - t0


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    plain = _run(work, "plain", args.probes_steps, [])
    import_s = _import_torch_s()
    checked = _run(work, "preflight", args.probes_steps, ["--preflight"])
    pre = [e for e in checked if e["kind"] == "preflight"]
    if not pre:
        return {"probes_note": "no preflight event was written"}
    preflight_s = float(pre[0]["seconds"])
    startup = _startup_s(plain)
    return {
        "preflight_s": round(preflight_s, 2),
        "preflight_startup_plain_s": round(startup, 2),
        "preflight_startup_checked_s": round(_startup_s(checked), 2),
        "preflight_ratio_startup": round(preflight_s / startup, 2),
        "preflight_torch_import_s": round(import_s, 2),
        "preflight_ratio_import": round(preflight_s / import_s, 2),
        "preflight_verdicts": sorted(f"{e['member']}:{e['verdict']}" for e in pre),
        "probe_skipped": sorted(
            {e["probe"] for e in checked if e["kind"] == "probe" and e.get("skipped")}
        ),
    }
