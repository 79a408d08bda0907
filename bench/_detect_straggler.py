"""Straggler figures of bench/detection.py: how soon a slowed rank is declared, how often
a fault-free run declares one, and the step rate after an eviction.

`stalwart run`s of bench/_straggler_job.py (2 workers, a DDP MLP, one thread each). The
fault-free run starts first and runs throughout: it is the *peer* of the slowed runs,
which run beside it one after the other, so every rate is compared with the peer's rate
over the same seconds (this machine's load moves a job's rate by 2x within a minute, and
a before/after ratio of one run measures the load, not the eviction):

- ``straggler_detect_s_3x``: rank 1 slowed 3x (chaos ``slow``, the agent's SIGSTOP/SIGCONT
  duty cycle) 25 s after the first step, under ``--strategy spare --spares 1
  --on-straggler evict``: the ``straggler`` event's latency (from the injected slowdown).
  The same run gives ``straggler_evict_rate_ratio``: its rate over the peer's in the
  20 s after the spare took over, divided by the same ratio in the 20 s before the
  slowdown (issue 16's bar: >= 0.95); ``straggler_evict_rate_ratio_raw`` is the run's
  own after/before ratio, ``straggler_slowed_rate_ratio`` the ratio while slowed;
- ``straggler_detect_s_1p5x``: rank 1 slowed 1.5x, ``--on-straggler report``; None if not
  declared within ``--straggler-timeout`` seconds of the slowdown;
- ``straggler_false_positives``: ``straggler`` events in the fault-free run over
  ``--straggler-fp-s`` seconds (issue 16's bar: 0 in 10 minutes: ``--straggler-fp-s
  600``), with ``straggler_false_positives_slowed``: declarations of the slowed runs'
  rank 0, which is never slowed.

Each run is ended with SIGTERM once it showed what is measured (its run_end says
``terminated``); the figures come from its events.jsonl alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from _straggler_trace import WindowTrace

HERE = Path(__file__).resolve().parent
_JOB = HERE / "_straggler_job.py"
_SLOW_AT_S = 25.0  # the slowdown's time after the first step
_SPAN_S = 20.0  # seconds of the rate windows before the slowdown and after the eviction


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--straggler-fp-s",
        type=float,
        default=120.0,
        help="seconds of the fault-free run (the issue's bar: 600)",
    )
    p.add_argument("--straggler-timeout", type=float, default=90.0,
                   help="seconds after a slowdown before it counts as not detected")  # fmt: skip


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # the line being written
    return out


def _rate(events: list[dict[str, Any]], a: float, b: float) -> float | None:
    """Steps per second of rank 0's ``steps`` batches that ended within [a, b]."""
    batches = [e for e in events if e["kind"] == "steps" and a <= e["t"] <= b]
    if len(batches) < 2:
        return None
    t0 = min(e["t_first_start"] for e in batches)
    return float(sum(e["count"] for e in batches) / (max(e["t"] for e in batches) - t0))


class _Run:
    """One `stalwart run` of the job in ``work/name``; ended with SIGTERM."""

    def __init__(self, work: Path, name: str, flags: list[str]) -> None:
        self.dir = work / name
        job = f"bench-{name}-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-m", "stalwart.cli.main", "run", "--nproc-per-node", "2",
               "--run-dir", str(self.dir), "--rdzv-id", job, *flags, str(_JOB)]  # fmt: skip
        self.log = open(work / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        # every scored window (its ratios), beside the agent's declarations
        self.trace = WindowTrace(job, 2, work / f"{name}.windows.jsonl")

    def first_step(self, timeout: float = 300.0) -> float | None:
        """Wall-clock start of the first step (the origin of ``at=time:``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            steps = [e for e in _events(self.dir) if e["kind"] == "steps"]
            if steps:
                return float(steps[0]["t_first_start"])
            time.sleep(0.5)
        return None

    def wait_for(self, kind: str, until: float) -> dict[str, Any] | None:
        while time.time() < until and self.proc.poll() is None:
            found = [e for e in _events(self.dir) if e["kind"] == kind]
            if found:
                return found[0]
            time.sleep(0.5)
        return None

    def stop(self) -> list[dict[str, Any]]:
        self.trace.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # the agent did not end: its workers die with it
                self.proc.wait()
        self.log.close()
        return _events(self.dir)


def _slowed(
    work: Path, name: str, factor: float, flags: list[str], timeout: float
) -> dict[str, Any]:
    chaos = f"slow rank=1 factor={factor:g} at=time:{_SLOW_AT_S:g}s"
    run = _Run(work, name, ["--chaos", chaos, *flags])
    out: dict[str, Any] = {"detect_s": None}
    try:
        t_first = run.first_step()
        if t_first is None:
            out["note"] = f"{name}: the job never stepped (rc {run.proc.poll()})"
            return out
        t_slow = t_first + _SLOW_AT_S
        found = run.wait_for("straggler", t_slow + timeout)
        if found is not None:
            out["detect_s"] = float(found["latency_s"])
            out["t_detected"], out["t_slow"], out["t_first"] = found["t"], t_slow, t_first
            if "evict" in flags:  # the steps after the spare took over
                ended = run.wait_for("recovery_end", time.time() + 60)
                if ended is not None:
                    out["t_recovered"] = ended["t"]
                    time.sleep(max(0.0, ended["t"] + _SPAN_S + 5 - time.time()))
    finally:
        out["events"] = run.stop()
        if "note" in out:
            tail = (work / f"{name}.log").read_text().strip().splitlines()[-3:]
            out["note"] += ": " + " | ".join(tail)
    return out


def _rate_ratios(three: dict[str, Any], peer: list[dict[str, Any]]) -> dict[str, float]:
    """The eviction's rate figures: the slowed run's rate over the peer's in each span."""
    ev, out = three["events"], {}
    spans = {
        "before": (three["t_slow"] - _SPAN_S, three["t_slow"]),
        "slowed": (three["t_slow"] + 2.0, three["t_detected"]),
        "after": (three["t_recovered"] + 3.0, three["t_recovered"] + 3.0 + _SPAN_S),
    }
    own = {k: _rate(ev, a, b) for k, (a, b) in spans.items()}
    rel = {}
    for k, (a, b) in spans.items():
        mine, theirs = own[k], _rate(peer, a, b)
        if mine and theirs:
            rel[k] = mine / theirs
    if "before" in rel and "after" in rel:
        out["straggler_evict_rate_ratio"] = round(rel["after"] / rel["before"], 3)
    if "before" in rel and "slowed" in rel:
        out["straggler_slowed_rate_ratio"] = round(rel["slowed"] / rel["before"], 3)
    if own["before"] and own["after"]:
        out["straggler_evict_rate_ratio_raw"] = round(own["after"] / own["before"], 3)
    return out


def _noise(three: dict[str, Any], peer: list[dict[str, Any]]) -> dict[str, Any]:
    """What the same after/before ratio is in the fault-free peer: every pair of spans
    as long and as far apart as the eviction run's, every 5 s of the peer's run (its
    10th and 90th percentiles): a ratio inside them is this machine's noise."""
    gap = three["t_recovered"] + 3.0 - three["t_slow"]
    steps = [e["t"] for e in peer if e["kind"] == "steps"]
    if not steps:
        return {}
    ratios, a = [], min(steps) + _SPAN_S + 5.0
    while a + gap + _SPAN_S <= max(steps):
        before, after = _rate(peer, a - _SPAN_S, a), _rate(peer, a + gap, a + gap + _SPAN_S)
        if before and after:
            ratios.append(after / before)
        a += 5.0
    if len(ratios) < 10:
        return {}
    ratios.sort()
    p10, p90 = (round(ratios[int(q * (len(ratios) - 1))], 3) for q in (0.1, 0.9))
    return {"straggler_fault_free_rate_ratio_p10_p90": [p10, p90]}


def _replacement(work: Path, t_recovered: float) -> dict[str, Any]:
    """The replaced rank's compute time per step over its peer's, window by window
    after the eviction (the agent's own scoring, traced): the median of those windows.
    About 1: the replacement is as fast as the rank it runs beside."""
    path = work / "slow3x.windows.jsonl"
    if not path.exists():
        return {}
    ratios = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["t"] > t_recovered + 6.0 and "1" in rec["ranks"]:
            ratios.append(rec["ranks"]["1"][0])
    if len(ratios) < 3:
        return {}
    ratios.sort()
    return {"straggler_evict_compute_ratio": ratios[len(ratios) // 2]}


def _declared_rank0(events: list[dict[str, Any]]) -> int:
    return sum(1 for e in events if e["kind"] == "straggler" and e["domain"]["rank"] == 0)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"straggler_load_avg_start": round(os.getloadavg()[0], 1)}
    peer = _Run(work, "fault_free", [])
    t_first = peer.first_step()
    evict = ["--strategy", "spare", "--spares", "1", "--on-straggler", "evict"]
    three = _slowed(work, "slow3x", 3.0, evict, args.straggler_timeout)
    res["straggler_detect_s_3x"] = three["detect_s"]
    one5 = _slowed(work, "slow1p5x", 1.5, ["--on-straggler", "report"], args.straggler_timeout)
    res["straggler_detect_s_1p5x"] = one5["detect_s"]
    res["straggler_false_positives_slowed"] = sum(
        _declared_rank0(p["events"]) for p in (three, one5)
    )
    if t_first is not None:
        time.sleep(max(0.0, t_first + args.straggler_fp_s - time.time()))
    ev = peer.stop()
    if three.get("t_recovered") is not None:
        res.update(_rate_ratios(three, ev))
        res.update(_noise(three, ev))
        res.update(_replacement(work, three["t_recovered"]))
    if t_first is None:
        res["straggler_false_positives"] = None
        res["straggler_note"] = "fault_free: the job never stepped (see its log)"
    else:
        res["straggler_false_positives"] = sum(1 for e in ev if e["kind"] == "straggler")
        steps = [e for e in ev if e["kind"] == "steps"]
        res["straggler_fault_free_s"] = round(max(e["t"] for e in steps) - t_first, 0)
    res["straggler_load_avg"] = round(os.getloadavg()[0], 1)
    for part in (three, one5):
        if "note" in part:
            res["straggler_note"] = part["note"]
    return res
