"""A run's figures, from its event log alone: load, compute, and render as JSON or text.

Why one object feeds every output: the terminal summary, the JSON document and the HTML
report must never disagree, so all three are views of :meth:`RunReport.to_dict`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.metrics._bucket_tiers import tier_lines, tier_section
from stalwart.metrics._health import health_lines, health_section
from stalwart.metrics._integrity import integrity_lines, integrity_section
from stalwart.metrics._run_log import ReportError, log_path
from stalwart.metrics._stragglers import straggler_lines, straggler_rows
from stalwart.metrics.console import domain_text
from stalwart.metrics.convergence import Convergence, convergence, loss_curve
from stalwart.metrics.events import Event, read_events
from stalwart.metrics.goodput import BUCKETS, Goodput, account
from stalwart.metrics.intervals import measure, union
from stalwart.metrics.stats import distribution, mtbf, percentile

__all__ = [
    "ReportError",
    "RunReport",
    "build_report",
    "format_summary",
    "incident_line",
    "load_run",
    "strategy_text",
]

REPORT_VERSION = 1


@dataclass
class RunReport:
    run_dir: str
    events: list[Event]
    goodput: Goodput
    partial: bool
    problems: list[str]
    reference_dir: str | None = None
    reference: dict[int, float] = field(default_factory=dict)
    convergence: list[Convergence] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (times relative to the run's start, seconds)."""
        g, t0 = self.goodput, self.goodput.t_start
        wall = g.wall_s
        start = next((e for e in self.events if e.kind == "run_start"), None)
        end = next((e for e in reversed(self.events) if e.kind == "run_end"), None)
        route = next((e for e in self.events if e.kind == "route"), None)
        fails = g.failures
        rtos = [i.rto_s for i in fails if i.rto_s is not None]
        lat = [i.detection_latency_s for i in fails if i.detection_latency_s is not None]
        m = mtbf(len(fails), wall)
        return {
            "report_version": REPORT_VERSION,
            "run_dir": self.run_dir,
            "job": None if start is None else start["job"],
            "strategy": None if start is None else start.get("strategy"),
            "route": None if route is None else route["route"],
            "status": None if end is None else end["status"],
            "partial": self.partial,
            "problems": self.problems,
            "t_start": t0,
            "wall_s": wall,
            # of the startup bucket, the agent's start before the workers (zygote, rendezvous)
            "launch_s": None if start is None else max(start.t - t0, 0.0),
            "ettr": g.ettr,
            "capacity_ettr": g.capacity_ettr,
            "buckets_s": dict(g.buckets),
            "buckets_fraction": {k: (v / wall if wall > 0 else None) for k, v in g.buckets.items()},
            "steps": {
                "productive": g.productive_steps,
                # None: a plain script resumed where stalwart cannot see (docs/goodput.md)
                "lost": None if g.lost_unknown else g.lost_steps,
                "lost_reported": sum(
                    int(e["steps_lost"])
                    for e in self.events
                    if e.kind == "recovery_end" and e["steps_lost"] is not None
                ),
                "last": max((w.last_step for w in g.windows), default=None),
                "productive_per_s": g.productive_steps / wall if wall > 0 else None,
            },
            "lost_work_s": g.buckets["lost_progress"],
            "incidents": [_incident(i, t0) for i in g.incidents],
            "stragglers": straggler_rows(self.events, t0),
            "health": health_section(self.events, t0),
            "integrity": integrity_section(self.events, t0),
            "failures": len(fails),
            "rto_s": asdict(distribution(rtos)),
            "detection_latency_s": asdict(distribution(lat)),
            "mtbf": asdict(m),
            "checkpoint": self._checkpoint(wall),
            "resumes": [{**asdict(r), "t": r.t - t0} for r in g.resumes],
            "world_size": [{"t": t - t0, "world_size": n} for t, n in g.world_sizes],
            "reference_dir": self.reference_dir,
            "convergence": [{**asdict(c), "resume_t": c.resume_t - t0} for c in self.convergence],
            "series": self._series(t0),
        }

    def _series(self, t0: float) -> dict[str, Any]:
        """What the plots draw: step batches, the bucket timeline, checkpoints, losses."""
        g = self.goodput
        return {
            "windows": [
                [
                    w.t0 - t0,
                    w.t1 - t0,
                    w.last_step - w.first_step + 1,
                    w.productive_steps,
                    w.world_size,
                ]
                for w in g.windows
            ],
            "segments": [[s.t0 - t0, s.t1 - t0, s.bucket] for s in g.segments],
            "snapshots": [e.t - t0 for e in self.events if e.kind == "snapshot"],
            "loss": [[e["step"], e["value"], e.t - t0] for e in self.events if e.kind == "loss"],
            "reference_loss": sorted([s, v] for s, v in self.reference.items()),
        }

    def _checkpoint(self, wall: float) -> dict[str, Any]:
        snaps = [e for e in self.events if e.kind == "snapshot"]
        ends = [e for e in self.events if e.kind == "persist_end"]
        busy = union((e.t - e["seconds"], e.t) for e in ends)
        persist_s = measure(busy, -math.inf, math.inf)
        stall = self.goodput.buckets["checkpoint_stall"]
        reported = measure(
            union((e.t - e["stall_s"], e.t) for e in snaps),
            self.goodput.t_start,
            self.goodput.t_end,
        )
        n = len({int(e["step"]) for e in snaps})
        written = sum(int(e.get("bytes_written", 0)) for e in ends if e["ok"])
        restores = [e for e in self.events if e.kind == "restore"]
        slow, slow_s = _persist_interference(self.goodput, busy)
        return {
            "snapshots": n,
            "stall_s": stall,
            "stall_pct": 100 * stall / wall if wall > 0 else None,
            "stall_reported_s": reported,
            "mean_stall_s": stall / n if n else None,
            "persists_ok": sum(1 for e in ends if e["ok"]),
            "persists_failed": sum(1 for e in ends if not e["ok"]),
            "persist_s": persist_s,
            "persist_pct": 100 * persist_s / wall if wall > 0 else None,
            "bytes_written": written,
            "write_bytes_per_s": written / persist_s if persist_s > 0 else None,
            "persist_slowdown": slow,
            "persist_overhead_s": slow_s,
            "persist_overhead_pct": None if slow_s is None or wall <= 0 else 100 * slow_s / wall,
            "restores": [
                {"step": e["step"], "tier": e["tier"], "seconds": e["seconds"]} for e in restores
            ],
            "tiers": tier_section(self.events),
        }


def _persist_interference(
    g: Goodput, persisting: list[tuple[float, float]]
) -> tuple[float | None, float | None]:
    """Step-time slowdown while a persist is in flight, and the training time it cost.

    Why measured this way: persisting runs in the background, so its cost is not a stall
    but slower steps (shared CPU, memory bandwidth, disk). Batches mostly inside a persist
    are compared with the median per-step time of the batches outside any; the cost is
    their compute beyond that baseline. None when either side has no batch.
    """
    inside: list[tuple[float, int]] = []
    outside: list[float] = []
    for w in g.windows:
        n = w.last_step - w.first_step + 1
        if n <= 0 or w.t1 <= w.t0:
            continue
        share = measure(persisting, w.t0, w.t1) / (w.t1 - w.t0)
        if share > 0.5:
            inside.append((w.busy_s, n))
        elif share == 0:
            outside.append(w.busy_s / n)
    if not inside or not outside:
        return None, None
    base = percentile(outside, 50)
    if base <= 0:
        return None, None
    per_step = math.fsum(b for b, _ in inside) / sum(n for _, n in inside)
    cost = math.fsum(max(b - n * base, 0.0) for b, n in inside)
    return per_step / base - 1.0, cost


def _incident(i: Any, t0: float) -> dict[str, Any]:
    return {
        "index": i.index,
        "fault": i.fault,
        "domain": i.domain,
        "injected": i.injected,
        "t_fault": i.t_fault - t0,
        "t_detected": None if i.t_detected is None else i.t_detected - t0,
        "t_resume": None if i.t_resume is None else i.t_resume - t0,
        "detection_latency_s": i.detection_latency_s,
        "rto_s": i.rto_s,
        "interrupted": i.interrupted,
        "detections": i.detections,
        "how": i.how,
        "strategy": i.strategy,
        "restored_step": i.restored_step,
        "steps_lost_reported": i.steps_lost_reported,
        "source_tier": i.source_tier,
        "during_recovery": i.during_recovery,
        "overlaps": i.overlaps,
    }


def build_report(
    run_dir: str, events: list[Event], *, partial: bool = False, problems: list[str] | None = None
) -> RunReport:
    """Figures for ``events`` (sorted by time), marking the report partial where the log
    does not show a whole run."""
    probs = list(problems or [])
    if not events:
        raise ReportError(
            f"{run_dir}: the event log holds no events; the run wrote nothing "
            "(did `stalwart run` start?)"
        )
    if not any(e.kind == "run_start" for e in events):
        partial = True
        probs.append(
            "no run_start event: the log's beginning is missing; wall time starts at "
            "the first event"
        )
    if not any(e.kind == "run_end" for e in events):
        partial = True
        probs.append(
            "no run_end event: the run was still going or its launcher died; "
            "figures stop at the last event"
        )
    g = account(events)
    probs.extend(g.problems)  # inconsistencies: warned about, but the log is whole
    return RunReport(run_dir, events, g, partial, probs)


def load_run(run_dir: str, *, reference: str | None = None, rel_band: float = 0.05) -> RunReport:
    """Read ``RUN_DIR/events.jsonl`` and compute every figure; with ``reference`` (another
    run directory) also the loss-convergence figures."""
    res = read_events(log_path(run_dir))
    rep = build_report(run_dir, res.events, partial=res.partial, problems=res.problems)
    if res.loss_stride > 1:  # a warning, not a partial log: the loss plot is thinned
        rep.problems.append(
            f"loss series thinned to one in {res.loss_stride} loss events (the log holds "
            "more than the report keeps in memory)"
        )
    if reference is not None:
        ref = loss_curve(read_events(log_path(reference)).events)
        if not ref:
            raise ReportError(
                f"{reference}: the reference run logged no loss; it needs `loss` events "
                "(sess.log(loss=...)) to compare against"
            )
        rep.reference_dir, rep.reference = reference, ref
        rep.convergence = convergence(res.events, rep.goodput.resumes, ref, rel_band=rel_band)
    return rep


def _f(x: float | None, fmt: str = ".1f", unit: str = "s") -> str:
    return "-" if x is None else f"{x:{fmt}}{unit}"


def strategy_text(d: dict[str, Any]) -> str:
    """The strategy the run asked for, and what a plain script got instead."""
    name = str(d.get("strategy") or "-")
    if d.get("route") == "plain":
        return f"{name} (plain script: torchrun's restart route, steps from its optimizer)"
    return name


def _detector_lines(d: dict[str, Any]) -> list[str]:
    """The soft detectors' lines (docs/detection.md): stragglers, node health, then the
    integrity checks (replica digests, numerical faults)."""
    return (
        straggler_lines(d.get("stragglers", []))
        + health_lines(d.get("health", {}))
        + integrity_lines(d.get("integrity", {}))
    )


def _headline(d: dict[str, Any]) -> str:
    """Wall time, ETTR and steps; a plain script's lost work that cannot be known is said
    so, and the ETTR and productive steps that include it are upper bounds."""
    ettr, lost = d["ettr"], d["steps"]["lost"]
    unknown = lost is None
    return (
        f"wall {d['wall_s']:.1f}s  ETTR {'<= ' * unknown}"
        f"{_f(None if ettr is None else 100 * ettr, '.1f', '%')}  "
        f"productive steps {d['steps']['productive']}{' at most' * unknown}  lost steps "
        + (
            "unknown (the script resumed from its own checkpoint at a step stalwart "
            "cannot see: its optimizer holds no step count)"
            if unknown
            else f"{lost} ({d['lost_work_s']:.1f}s)"
        )
    )


def incident_line(i: dict[str, Any]) -> str:
    """One incident of the report's document as a line of words (no Python reprs)."""
    restored = ""
    if i.get("restored_step") is not None:
        tier = f" from {i['source_tier']}" if i.get("source_tier") else ""
        restored = f"  restored step {i['restored_step']}{tier}"
    return (
        f"  incident {i['index']}: {i['fault']} of {domain_text(i['domain'])} at "
        f"{i['t_fault']:.2f}s  detected after {_f(i['detection_latency_s'], '.2f')}  "
        f"RTO {_f(i['rto_s'], '.2f')}{restored}"
        + ("  (during recovery)" if i["during_recovery"] else "")
        + ("" if i["interrupted"] else "  (no interruption)")
    )


def format_summary(d: dict[str, Any]) -> str:
    """The terminal summary of a :meth:`RunReport.to_dict` document. Every string that
    comes from the event log is printed with its control characters escaped (an ESC
    sequence in events.jsonl must not reach the terminal): logs.terminal_safe."""
    from stalwart.logs import terminal_safe

    def t(value: Any) -> str:
        return terminal_safe(str(value))

    lines = [
        f"run {t(d['run_dir'])}  job={t(d['job'] or '-')}  strategy={t(strategy_text(d))}  "
        f"status={t(d['status'] or 'unknown (no run_end)')}",
    ]
    if d["partial"]:
        lines.append("PARTIAL REPORT: " + "; ".join(t(p) for p in d["problems"][:3]))
    elif d["problems"]:
        lines.append("warnings: " + "; ".join(t(p) for p in d["problems"][:3]))
    lines.append(_headline(d))
    cap = d["capacity_ettr"]
    if cap is not None and len({w["world_size"] for w in d["world_size"]}) > 1:
        lines.append(f"capacity ETTR {100 * cap:.1f}% (productive time x world size / max)")
    lines.append("time by bucket:")
    for k in BUCKETS:
        v = d["buckets_s"][k]
        frac = d["buckets_fraction"][k]
        pct = _f(None if frac is None else 100 * frac, "6.2f", "%")
        launch = d.get("launch_s") if k == "startup" else None
        more = f"  ({launch:.2f}s of it before the workers started)" if launch else ""
        lines.append(f"  {k:<17}{v:10.2f}s {pct}{more}")
    r, lat, m = d["rto_s"], d["detection_latency_s"], d["mtbf"]
    lines.append(
        f"failures {d['failures']}  RTO p50 {_f(r['p50'], '.2f')} p95 {_f(r['p95'], '.2f')} "
        f"max {_f(r['max'], '.2f')}  detection p50 {_f(lat['p50'], '.2f')}"
    )
    lines.append(
        f"MTBF {_f(m['mtbf_s'])} ({100 * m['confidence']:.0f}% CI {_f(m['lower_s'])} .. "
        f"{_f(m['upper_s']) if m['upper_s'] is not None else 'unbounded'})"
    )
    c = d["checkpoint"]
    lines.append(
        f"checkpoints {c['snapshots']}  stall {_f(c['stall_pct'], '.2f', '%')} of wall  "
        f"persist {_f(c['persist_pct'], '.2f', '%')} of wall (background, costing "
        f"{_f(c['persist_overhead_pct'], '.2f', '%')})  "
        f"failed persists {c['persists_failed']}"
    )
    lines += tier_lines(c["tiers"], t)
    for i in d["incidents"]:
        lines.append(t(incident_line(i)))
    lines += [t(line) for line in _detector_lines(d)]
    for cv in d["convergence"]:
        s = cv["steps_to_converge"]
        lines.append(
            f"  after resume at step {cv['resume_step']} ({t(cv['cause'])}): "
            + ("never back within the band" if s is None else f"within band after {s} steps")
        )
    return terminal_safe("\n".join(lines), newlines=True)
