"""Benchmark: elastic shrink and grow against flash recovery and torchft, on one machine.

One `stalwart run --strategy elastic` of examples/train_elastic.py with 4 gloo workers
(the demo's transformer, plus ``--ballast-mb`` of extra tracked state so that the state
transfer moves a realistic number of bytes); rank 1 is killed with SIGKILL at step 40
(not permanent: the agent starts it again and it rejoins). From the run's event log:

- ``shrink_rto_s``: the fault to the end of the first step of the smaller group;
- ``grow_stall_s``: how long the survivors stopped when the member joined (from the step
  boundary where they stopped to the re-formed group: snapshot, second transfer, commit);
  ``grow_transfer_s`` is the transfer's share of it;
- ``transfer_gbps``: that boundary transfer's rate (bytes / seconds as the sender timed
  them), with ``loopback_gbps`` a raw loopback copy of a slot of the same size measured
  right after each elastic run (bench/transfer.py's method), ``transfer_vs_loopback``
  their ratio per repetition (median);
- ``flash_rto_s``: the same job and fault under ``--strategy flash`` (the dead worker
  forked again, everyone restores from memory).

torchft side by side when it is importable (``pip install 'stalwart[bench]'``, or
``--torchft-path DIR`` for a private install): two replica groups on gloo, one killed
with SIGKILL at step 50, ``torchft_survivor_stall_s`` with its defaults and with a 1 s
heartbeat timeout (bench/_torchft_job.py).

Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "train_elastic.py"
sys.path.insert(0, str(ROOT / "bench"))


def _events(run_dir: Path) -> list[dict[str, Any]]:
    out = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x]
    return sorted(out, key=lambda e: float(e["t"]))


def _first_step_end(events: list[dict[str, Any]], generation: int) -> float | None:
    """End of the first step rank 0 completed in ``generation`` (or a later one)."""
    for e in events:
        if e["kind"] == "steps" and int(e.get("generation", -1)) >= generation:
            return float(e["t_first_start"]) + float(e["busy_s"]) / int(e["count"])
    return None


def run_job(work: Path, strategy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    run_dir = work / strategy
    shutil.rmtree(run_dir, ignore_errors=True)
    procs = "3:4" if strategy == "elastic" else "4"
    cmd = [
        sys.executable,
        "-m",
        "stalwart.cli.main",
        "run",
        "--nproc-per-node",
        procs,
        "--strategy",
        strategy,
        "--rdzv-id",
        f"bench-el-{uuid.uuid4().hex[:6]}",
        "--run-dir",
        str(run_dir),
        "--redirect",
        # a loaded 2-core VM can starve a heartbeat for over 1 s; hangs are not measured here
        "--hang-floor",
        "10",
        "--chaos",
        f"kill rank=1 at=step:{args.kill_step}",
        str(JOB),
        "--steps",
        str(args.steps),
        "--dim",
        "128",
        "--layers",
        "2",
        "--seq",
        "64",
        "--global-batch",
        "24",
        "--micro-batch",
        "6",
        "--ballast-mb",
        str(args.ballast_mb),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(work / f"{strategy}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the agent cleans up its workers and shared memory
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rc = -1
    finally:
        log.close()
    if rc != 0:
        args.keep = True
        raise SystemExit(f"{strategy} run failed (rc {rc}); see {run_dir} and {log.name}")
    return _events(run_dir)


def elastic_figures(events: list[dict[str, Any]]) -> dict[str, Any]:
    fault = next(float(e["t"]) for e in events if e["kind"] == "fault_injected")
    resizes = [e for e in events if e["kind"] == "resize"]
    shrink = next(e for e in resizes if e["reason"] == "shrink")
    grow = next((e for e in resizes if e["reason"] == "grow"), None)
    end = _first_step_end(events, int(shrink["generation"]))
    out: dict[str, Any] = {
        "shrink_rto_s": None if end is None else end - fault,
        "shrink_reform_s": float(shrink["t"]) - fault,
        "shrink_world": [shrink["from_world_size"], shrink["world_size"]],
        "shrink_micro_batches": shrink.get("micro_batches"),
    }
    detected = [e for e in events if e["kind"] == "fault_detected"]
    if detected:
        out["crash_detect_s"] = float(detected[0]["latency_s"])
    if grow is not None:
        secs = float(grow["transfer_s"])
        out |= {
            "grow_stall_s": float(grow["stall_s"]),
            "grow_transfer_s": secs,
            "grow_transfer_bytes": int(grow["transfer_bytes"]),
            "transfer_gbps": int(grow["transfer_bytes"]) / secs / 1e9 if secs > 0 else None,
            "rejoin_after_fault_s": float(grow["t"]) - fault,
        }
    received = [e for e in events if e["kind"] == "state_received"]
    out["joiner_state_bit_identical"] = bool(received) and all(
        e["digest"] == e["sender_digest"] for e in received
    )
    return out


def flash_figures(events: list[dict[str, Any]]) -> dict[str, Any]:
    fault = next(float(e["t"]) for e in events if e["kind"] == "fault_injected")
    rec = next(e for e in events if e["kind"] == "recovery_end" and float(e["t"]) > fault)
    end = _first_step_end(events, int(rec["generation"]))
    return {"flash_rto_s": None if end is None else end - fault}


def loopback(mb: int) -> dict[str, Any]:
    from transfer import measure  # bench/transfer.py

    r = measure(mb=mb, reps=2)
    return {
        "loopback_gbps": r["loopback_gbps"],
        "synthetic_transfer_gbps": r["transfer_gbps"],
    }


def torchft(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = dict(os.environ)
    if args.torchft_path:
        env["PYTHONPATH"] = os.pathsep.join([args.torchft_path, env.get("PYTHONPATH", "")])
    probe = subprocess.run(
        [sys.executable, "-c", "import torchft"], env=env, capture_output=True, timeout=120
    )
    if probe.returncode != 0:
        return {"torchft": "not installed (pip install 'stalwart[bench]')"}
    out: dict[str, Any] = {}
    for label, timeout in (("default", None), ("1s", 1.0)):
        cmd = [sys.executable, str(ROOT / "bench" / "_torchft_job.py"), "--work", str(work)]
        if timeout is not None:
            cmd += ["--heartbeat-timeout", str(timeout)]
        proc = subprocess.run(cmd, env=env, capture_output=True, timeout=300, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            out[f"torchft_{label}_error"] = proc.stderr[-500:]
            continue
        stall = json.loads(lines[-1]).get("survivor_stall_s")
        key = "torchft_survivor_stall_s" if label == "default" else "torchft_survivor_stall_1s_s"
        out[key] = stall
    return out


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-step", type=int, default=40)
    p.add_argument("--ballast-mb", type=int, default=128)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--torchft-path", default=None, help="a private torchft install")
    p.add_argument("--skip-torchft", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-elastic-"))
    load_before = _load()
    runs: dict[str, list[float]] = {}
    extra: dict[str, Any] = {}
    try:
        for rep in range(args.reps):
            el = elastic_figures(run_job(work, "elastic", args))
            el |= loopback(args.ballast_mb + 2)  # right after it, under the same load
            if el.get("transfer_gbps"):
                el["transfer_vs_loopback"] = el["transfer_gbps"] / el["loopback_gbps"]
            fl = flash_figures(run_job(work, "flash", args))
            for k, v in (el | fl).items():
                if isinstance(v, float):
                    runs.setdefault(k, []).append(v)
                else:
                    extra[k] = v if rep == 0 or k not in extra else extra[k]
            extra["joiner_state_bit_identical"] = extra.get(
                "joiner_state_bit_identical", True
            ) and bool(el.get("joiner_state_bit_identical"))
            print(f"rep {rep}: {json.dumps(el | fl, default=str)}", file=sys.stderr)
        result: dict[str, Any] = {k: round(statistics.median(v), 4) for k, v in runs.items()}
        result |= extra
        if not args.skip_torchft:
            result |= torchft(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["reps"], result["load_avg"] = args.reps, f"{load_before} -> {_load()}"
    checks = {
        "shrink_rto_s <= 1.0": (result.get("shrink_rto_s") or 99) <= 1.0,
        "grow_stall_s <= 1.0 + transfer": (result.get("grow_stall_s") or 99)
        <= 1.0 + (result.get("grow_transfer_s") or 0.0),
        "transfer >= 0.5 x loopback": (result.get("transfer_vs_loopback") or 0) >= 0.5,
    }
    best_ft = min(
        (v for k, v in result.items() if k.startswith("torchft_survivor_stall") and v),
        default=None,
    )
    if best_ft is not None:
        checks["shrink_rto_s < torchft best stall"] = (result.get("shrink_rto_s") or 99) < best_ft
    result["acceptance"] = checks
    print(f"\n{'figure':<32}{'value':>12}")
    for key in (
        "shrink_rto_s",
        "shrink_reform_s",
        "crash_detect_s",
        "grow_stall_s",
        "grow_transfer_s",
        "transfer_gbps",
        "loopback_gbps",
        "transfer_vs_loopback",
        "synthetic_transfer_gbps",
        "flash_rto_s",
        "torchft_survivor_stall_s",
        "torchft_survivor_stall_1s_s",
    ):
        value = result.get(key)
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<32}{shown:>12}")
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"load average {result['load_avg']}; {time.strftime('%H:%M:%S')}")
    print(json.dumps({"bench": "elastic", **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
