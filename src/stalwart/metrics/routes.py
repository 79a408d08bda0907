"""The figures of ``stalwart compare``: one job, one fault trace, several recovery routes.

Every route (torchrun with a torch.save resume, stalwart's strategies) is judged by the
same yardstick, read from what the corpus scripts record on member 0 (rank 0 at launch:
``trace-m0.jsonl``, one line per committed attempt of a step with its wall clock ``t``)
and from the launcher's own start and exit, so that no route's own accounting grades it
(torchrun has none). Definitions (docs/routes.md):

- training span: first step record to last (member 0); startup counted only in the time
  to the target.
- ETTR: productive time over the training span of the same run, productive being the
  durations of the kept steps (the last attempt of each step, from the record before it
  in the same attempt; a step right after a resume, and a step that ends inside a
  fault's recovery, count the run's median step). Both come from the one run, so the
  machine's load drifting between a route's fault-free and faulted runs does not move
  it: a fault-free run is at ~1.0.
- utilisation: productive worker-seconds over held worker-seconds: the productive time
  of every member's records (``trace-m<M>.jsonl``: a replica group that is down while the
  others go on is idle there) over ``(W + spares) x`` the training span; a standby held
  for the job is a worker paid for. Without the other members' records: ``ETTR x W /
  (W + spares)``.
- RTO of a fault: its instant to member 0's first step record after it that shows the
  job going again: the first of a new attempt (a rollback, a restart or a new
  generation), or, where member 0 went on in the same attempt (a survivor of torchft or
  async), the end of the first step begun after the fault that took at most twice the
  run's median step (a survivor stalled in a collective until the dead peer is dropped
  is not going again). The fault's recovery is the time from the instant to that record.
  Steps lost: the newest step committed before that record (steps in flight at the fault
  included) less the one it resumed from.
- struck rank back: per fault, its instant to the first step record of a new attempt, or
  of a new process, on the struck rank's own member (``trace-m<rank>.jsonl``; an async
  group restarted keeps its attempt): when the rank that was killed trains again. Under
  a synchronous route it is the RTO; under async and torchft, where member 0 need not
  stop, it is the failed group's own recovery. None where the struck member writes no
  new attempt (a standby took its rank and records as itself).
- final loss: the mean loss of the last tenth (at least 5) of the kept steps (the last
  attempt of each step); the loss gap: the faulted run's loss less the fault-free run's
  (same route) at the same steps, averaged over those last kept steps (for a run stopped
  before its target, at the steps it reached).
- a run that met no fault: none of the trace's faults fired before the job ended (its
  steps outran the trace's first instant); its fault figures are not shown (None) and its
  row says so (``met_faults`` false, metrics/_routes_met.py).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.metrics._routes_met import FaultsMet, before_target, faults_met

__all__ = [
    "ROUTES_VERSION",
    "FaultsMet",
    "Recovery",
    "RouteFigures",
    "RouteRun",
    "StepRecord",
    "before_target",
    "compare_document",
    "faults_met",
    "kept_losses",
    "productive_s",
    "read_step_records",
    "recoveries",
    "route_figures",
]

ROUTES_VERSION = 2
"""Version of the JSON document ``stalwart compare`` writes (docs/routes.md)."""


@dataclass(frozen=True)
class StepRecord:
    """One committed attempt of a step on member 0 (``attempt``: restart count, generation)."""

    step: int
    attempt: tuple[int, int]
    t: float
    loss: float | None
    pid: int = 0  # the process that recorded it (a restarted group keeps its attempt)


@dataclass(frozen=True)
class RouteRun:
    """One run of one route as ``stalwart compare`` observed it."""

    route: str
    workers: int
    spares: int
    target: int
    launched: float  # wall clock at launch
    exited: float  # wall clock at the launcher's exit
    rc: int
    records: tuple[StepRecord, ...]
    faults_at: tuple[float, ...] = ()  # wall clock of each fault that fired
    member_records: tuple[tuple[StepRecord, ...], ...] = ()  # every member's, for utilisation
    fault_ranks: tuple[int, ...] = ()  # the rank each fault of faults_at struck
    planned_at: tuple[float, ...] = ()  # the trace's instants, s after the first step
    late_faults: int = 0  # faults that fired past the target step: not counted (unfired)
    sim: dict[str, Any] = field(default_factory=dict)  # the simulator's replay, if any

    @property
    def span_s(self) -> float | None:
        if len(self.records) < 2:
            return None
        return self.records[-1].t - self.records[0].t

    @property
    def reached(self) -> bool:
        """Finished the target: the target step kept, with exit 0 or a failure that a fault
        fired past that step caused (_routes_met.before_target)."""
        ok = self.rc == 0 or self.late_faults > 0
        return ok and any(r.step >= self.target for r in self.records)


@dataclass(frozen=True)
class Recovery:
    t_fault: float
    rto_s: float | None  # None: the route never resumed
    steps_lost: int | None


def read_step_records(path: str | Path) -> tuple[StepRecord, ...]:
    """Member 0's step records from a corpus script's ``trace-m0.jsonl`` (torn last line
    skipped: a killed process may leave one)."""
    p = Path(path)
    if not p.exists():
        return ()
    out = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
            att = rec["attempt"]
            loss = rec.get("loss")
            out.append(
                StepRecord(
                    int(rec["step"]),
                    (int(att[0]), int(att[1])),
                    float(rec["t"]),
                    float(loss) if isinstance(loss, (int, float)) else None,
                    int(rec.get("pid", 0)),
                )
            )
        except (ValueError, KeyError, TypeError, IndexError):
            continue
    return tuple(out)


def kept_losses(records: tuple[StepRecord, ...]) -> list[tuple[int, float]]:
    """(step, loss) of the last attempt of each step, by step."""
    last: dict[int, float] = {}
    for r in records:
        if r.loss is not None and math.isfinite(r.loss):
            last[r.step] = r.loss
    return sorted(last.items())


def _final_loss(records: tuple[StepRecord, ...]) -> float | None:
    kept = kept_losses(records)
    if not kept:
        return None
    tail = kept[-max(5, len(kept) // 10) :]
    return math.fsum(v for _, v in tail) / len(tail)


def _loss_gap(run: tuple[StepRecord, ...], ref: tuple[StepRecord, ...]) -> float | None:
    """Mean of run minus ref over the last tenth (at least 5) of run's kept steps that ref
    has too: the same step counts, also for a run stopped before its target."""
    kept, other = kept_losses(run), dict(kept_losses(ref))
    tail = [(s, v) for s, v in kept[-max(5, len(kept) // 10) :] if s in other]
    if not tail:
        return None
    return math.fsum(v - other[s] for s, v in tail) / len(tail)


def _paired(records: tuple[StepRecord, ...]) -> list[tuple[int, float]]:
    """(index, duration) of every record timed from the one before it in the same attempt
    (the previous step of that attempt)."""
    out = []
    last: dict[tuple[int, int], StepRecord] = {}
    for i, r in enumerate(records):
        p = last.get(r.attempt)
        if p is not None and p.step == r.step - 1 and r.t >= p.t:
            out.append((i, r.t - p.t))
        last[r.attempt] = r
    return out


def _median_step(records: tuple[StepRecord, ...]) -> float:
    durations = [d for _, d in _paired(records)]
    return statistics.median(durations) if durations else 0.0


def _resumed_at(records: tuple[StepRecord, ...], t_f: float, median: float) -> int | None:
    """Index of member 0's record that shows the job going again after a fault at ``t_f``
    (see the module's RTO), None if none does."""
    before = [r for r in records if r.t <= t_f]
    if not before:
        return None
    attempt = before[-1].attempt
    durations = dict(_paired(records))
    for i, r in enumerate(records):
        if r.t <= t_f:
            continue
        if r.attempt != attempt:
            return i
        prev = records[i - 1] if i else None
        normal = i in durations and durations[i] <= 2 * median
        if normal and prev is not None and prev.attempt == attempt and prev.t > t_f:
            return i
    return None


def recoveries(records: tuple[StepRecord, ...], faults_at: tuple[float, ...]) -> list[Recovery]:
    """Each fault's RTO and steps lost, from member 0's records (definitions above)."""
    out = []
    median = _median_step(records)
    for t_f in faults_at:
        i = _resumed_at(records, t_f, median)
        if i is None:
            out.append(Recovery(t_f, None, None))
            continue
        nxt = records[i]
        # Steps still committed after the fault (in flight) are redone too.
        newest = max(r.step for r in records if r.t < nxt.t)
        out.append(Recovery(t_f, nxt.t - t_f, max(newest - (nxt.step - 1), 0)))
    return out


def productive_s(records: tuple[StepRecord, ...], faults_at: tuple[float, ...] = ()) -> float:
    """Seconds of the kept steps (see the module's ETTR); a step that ends inside a fault's
    recovery (its instant to the record that shows the job going again) counts the median."""
    median = _median_step(records)
    windows = []
    for t_f in faults_at:
        i = _resumed_at(records, t_f, median)
        windows.append((t_f, records[i].t if i is not None else math.inf))
    durations = dict(_paired(records))
    kept = {r.step: i for i, r in enumerate(records)}
    total, unpaired = 0.0, 0
    for i in kept.values():
        t = records[i].t
        if i in durations and not any(a < t <= b for a, b in windows):
            total += durations[i]
        else:
            unpaired += 1
    return total + unpaired * median


def _ettr(records: tuple[StepRecord, ...], faults_at: tuple[float, ...] = ()) -> float | None:
    if len(records) < 2:
        return None
    productive = productive_s(records, faults_at)
    first_step = productive / max(len({r.step for r in records}), 1)
    return productive / (records[-1].t - records[0].t + first_step)


def _utilisation(run: RouteRun, ettr: float) -> float:
    """Productive worker-seconds over held worker-seconds (see the module's utilisation)."""
    held = run.workers + run.spares
    if len(run.member_records) < 2 or len(run.records) < 2:
        return ettr * run.workers / held
    productive = [productive_s(m, run.faults_at) for m in run.member_records if m]
    steps = max(len({r.step for r in run.records}), 1)
    first_step = productive_s(run.records, run.faults_at) / steps
    span = run.records[-1].t - run.records[0].t + first_step
    return min(1.0, math.fsum(productive) / (held * span))


def _struck_back(run: RouteRun) -> list[float]:
    """Each fault's instant to the struck member's first record of a new attempt."""
    out = []
    for t_f, rank in zip(run.faults_at, run.fault_ranks, strict=False):
        recs = run.member_records[rank] if 0 <= rank < len(run.member_records) else ()
        before = [r for r in recs if r.t <= t_f]
        if not before:
            continue
        was = (before[-1].attempt, before[-1].pid)
        nxt = next((r for r in recs if r.t > t_f and (r.attempt, r.pid) != was), None)
        if nxt is not None:
            out.append(nxt.t - t_f)
    return sorted(out)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return float(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1])


@dataclass(frozen=True)
class RouteFigures:
    """A route's row of the table (None: not measured, with the reason in ``note``)."""

    route: str
    reached: bool
    time_to_target_s: float | None
    fault_free_s: float | None
    ettr: float | None
    utilisation: float | None
    rto_p50_s: float | None
    rto_p95_s: float | None
    struck_back_p50_s: float | None
    faults: int
    recovered: int
    steps_lost: int
    final_loss: float | None
    fault_free_loss: float | None
    loss_gap: float | None
    sim_predicted_ettr: float | None = None
    sim_measured_ettr: float | None = None
    note: str = ""
    planned: int = 0  # the trace's faults
    met_faults: bool = True  # False: none fired, the figures above are not shown (None)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def route_figures(run: RouteRun, fault_free: RouteRun) -> RouteFigures:
    """The table row of ``run`` (faulted) against ``fault_free`` (the same route, no
    faults); a run none of whose planned faults fired shows no fault figure (it ran fault
    free: metrics/_routes_met.py)."""
    recs = recoveries(run.records, run.faults_at)
    rtos = sorted(r.rto_s for r in recs if r.rto_s is not None)
    met = faults_met(run.planned_at, len(run.faults_at), run.span_s)
    ettr = _ettr(run.records, run.faults_at) if run.reached and met.met else None
    final, ff_final = _final_loss(run.records), _final_loss(fault_free.records)
    notes = [met.note] if met.note else []
    if run.late_faults:
        notes.append(
            f"{run.late_faults} fault(s) fired after step {run.target} was recorded (the "
            f"job's last step): not counted; exit {run.rc}"
        )
    if not run.reached:
        why = "stopped at the cap" if run.rc == -9 else f"exit {run.rc}"
        notes.append(f"did not reach step {run.target} ({why})")
    if not fault_free.reached:
        notes.append(f"its fault-free run did not finish (exit {fault_free.rc})")
    shown = met.met  # a run that met no fault shows no fault figure (None)
    return RouteFigures(
        route=run.route,
        reached=run.reached,
        time_to_target_s=run.exited - run.launched if run.reached and shown else None,
        fault_free_s=fault_free.exited - fault_free.launched if fault_free.reached else None,
        ettr=ettr,
        utilisation=None if ettr is None else _utilisation(run, ettr),
        rto_p50_s=_pct(rtos, 50),
        rto_p95_s=_pct(rtos, 95),
        struck_back_p50_s=_pct(_struck_back(run), 50),
        faults=len(recs),
        recovered=len(rtos),
        steps_lost=sum(r.steps_lost or 0 for r in recs),
        final_loss=final,
        fault_free_loss=ff_final,
        loss_gap=_loss_gap(run.records, fault_free.records) if shown else None,
        sim_predicted_ettr=run.sim.get("predicted_ettr") if shown else None,
        sim_measured_ettr=run.sim.get("measured_ettr") if shown else None,
        note="; ".join(notes + ([str(run.sim["note"])] if run.sim.get("note") else [])),
        planned=met.planned,
        met_faults=met.met,
    )


def compare_document(
    job: dict[str, Any],
    trace: dict[str, Any],
    rows: list[RouteFigures],
    curves: dict[str, list[tuple[int, float]]],
    absent: dict[str, str],
) -> dict[str, Any]:
    """The JSON document (``version`` 2): the job, the trace, a row per route, the kept loss
    curves (faulted and ``<route>/fault-free``), and the routes not run with why."""
    return {
        "version": ROUTES_VERSION,
        "job": job,
        "trace": trace,
        "routes": {r.route: r.to_dict() for r in rows},
        "absent": absent,
        "curves": {k: [[s, v] for s, v in pts] for k, pts in curves.items()},
    }
