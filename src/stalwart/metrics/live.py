"""Live figures while a run works: fed event by event, read by the console and the
Prometheus exporter.

Why incremental and approximate where the report is exact: a live display must cost
O(1) per event on the launcher's hot path, so it cannot re-partition the timeline. It
counts lost work when a recovery reports its ``restored_step`` (the report instead waits
to see which steps are redone), and it shows the latest RTO as fault to resumption.
``stalwart report`` is the reference; these are a progress display.

``emit`` has :meth:`EventLog.emit`'s signature, so a launcher can feed the log and every
live sink through one :class:`EventTee`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["EventSink", "EventTee", "LiveFigures", "LiveSnapshot"]


class EventSink(Protocol):
    def emit(
        self, kind: str, *, t: float | None = None, rank: int | None = None, **fields: Any
    ) -> None: ...


class EventTee:
    """Sends each event to every sink with one timestamp (the event log first, so an
    invalid event raises before any display shows it)."""

    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = sinks

    def emit(
        self, kind: str, *, t: float | None = None, rank: int | None = None, **fields: Any
    ) -> None:
        when = time.time() if t is None else t
        for s in self.sinks:
            s.emit(kind, t=when, rank=rank, **fields)


@dataclass(frozen=True)
class LiveSnapshot:
    t: float
    elapsed_s: float
    status: str  # "starting", "training", "recovering", "ended"
    step: int | None
    steps_total: int  # completions, redone steps included
    steps_per_s: float | None  # over the recent rate window
    busy_s: float
    lost_s: float
    lost_steps: int
    ettr: float | None  # (busy - lost) / elapsed
    incidents: int
    last_rto_s: float | None
    last_detection_s: float | None
    world_size: int | None
    generation: int | None
    checkpoints: int
    stall_s: float
    persists_ok: int
    persists_failed: int
    persist_s: float
    persisted_bytes: int
    restores: int
    restore_s: float
    stragglers: int = 0  # ranks declared stragglers (agent/detection/stragglers.py)
    # the probes' last readings, (node, probe, device, 1 ok / 0 failing); skipped ones out
    probes: tuple[tuple[str, str, str, int], ...] = ()
    probe_failures: int = 0  # probe readings that started failing (ok false, not skipped)
    preflight_s: float | None = None  # the latest preflight node check's wall time
    preflight: tuple[tuple[str, int], ...] = ()  # (member, 1 fit / 0 unfit) per node checked
    sdc_checks: int = 0  # replica digest checks every replica passed (runtime/integrity/_checks.py)
    sdc_detections: int = 0  # replica digest mismatches
    numeric_faults: int = 0  # NaN/inf/spiking logged losses (one per step and action)
    sdc_last_check_step: int | None = None  # the newest step every replica agreed on


class LiveFigures:
    """Running totals of a run's events; :meth:`snapshot` reads them."""

    def __init__(self, *, rate_window_s: float = 30.0, keep_batches: int = 100_000) -> None:
        self.rate_window_s = rate_window_s
        self.t_start: float | None = None
        self.t_last: float | None = None
        self.status = "starting"
        self.step: int | None = None
        self.steps_total = 0
        self.busy_s = self.lost_s = 0.0
        self.lost_steps = 0
        self.incidents = 0
        self.last_rto_s: float | None = None
        self.last_detection_s: float | None = None
        self.world_size: int | None = None
        self.generation: int | None = None
        self.checkpoints = 0
        self.stall_s = 0.0
        self.persists_ok = self.persists_failed = 0
        self.persist_s = 0.0
        self.persisted_bytes = 0
        self.restores = 0
        self.restore_s = 0.0
        self.stragglers = 0
        self.probe_failures = 0
        self.preflight_s: float | None = None
        self.sdc_checks = self.sdc_detections = 0
        self.sdc_last_check_step: int | None = None
        self._numeric: set[tuple[int, str, int]] = set()  # (step, action, restored_step)
        self._probes: dict[tuple[str, str, str], int] = {}
        self._preflight: dict[str, int] = {}
        self._open_faults: list[float] = []  # fault times awaiting resumption
        self._recovery_began = self._recovery_done = self._detected = False
        self._snapshot_steps: deque[int] = deque(maxlen=64)
        self._recent: deque[tuple[float, float, int]] = deque()  # (t0, t1, count)
        self._batches: deque[tuple[int, int, float]] = deque(maxlen=keep_batches)

    def emit(self, kind: str, *, t: float | None = None, rank: int | None = None, **f: Any) -> None:
        """Take one event (same arguments as :meth:`EventLog.emit`)."""
        t = time.time() if t is None else t
        if kind == "run_start":  # the wall time runs from the launch (docs/goodput.md)
            t0 = min(float(f.get("launch_t", t)), t)
            self.t_start = t0 if self.t_start is None else min(self.t_start, t0)
        elif self.t_start is None:
            self.t_start = t
        self.t_last = t if self.t_last is None else max(self.t_last, t)
        handler = getattr(self, "_on_" + kind, None)
        if handler is not None:
            handler(t, f)

    def _on_run_start(self, t: float, f: dict[str, Any]) -> None:
        self.world_size = int(f["world_size"])

    def _on_run_end(self, t: float, f: dict[str, Any]) -> None:
        self.status = "ended"

    def _on_generation(self, t: float, f: dict[str, Any]) -> None:
        self.generation, self.world_size = int(f["generation"]), int(f["world_size"])

    def _on_resize(self, t: float, f: dict[str, Any]) -> None:
        self.world_size = int(f["world_size"])

    def _on_steps(self, t: float, f: dict[str, Any]) -> None:
        t0, n = float(f["t_first_start"]), int(f["count"])
        if self._open_faults and t0 >= max(self._open_faults):
            if self._recovery_began and self._recovery_done:
                self.last_rto_s = t0 - min(self._open_faults)  # the whole outage
                self._open_faults.clear()
            elif self._detected and not self._recovery_began:
                self._open_faults.clear()  # seen, but training never stopped for it
        self.status = "training"
        self.step, self.steps_total = int(f["last_step"]), self.steps_total + n
        self.busy_s += float(f["busy_s"])
        self._batches.append((int(f["first_step"]), int(f["last_step"]), float(f["busy_s"])))
        self._recent.append((t0, t, n))
        while self._recent and self._recent[0][1] < t - self.rate_window_s:
            self._recent.popleft()

    def _fault(self, t: float) -> None:
        if not self._open_faults:
            self._recovery_began = self._recovery_done = self._detected = False
        self._open_faults.append(t)
        self.incidents += 1

    def _on_fault_injected(self, t: float, f: dict[str, Any]) -> None:
        self._fault(t)

    def _on_fault_detected(self, t: float, f: dict[str, Any]) -> None:
        self.last_detection_s = float(f["latency_s"])
        if not self._open_faults:  # a fault nobody injected (else already counted)
            self._fault(t - float(f["latency_s"]))
        self._detected = True

    def _on_recovery_begin(self, t: float, f: dict[str, Any]) -> None:
        self.status, self._recovery_began, self._recovery_done = "recovering", True, False

    def _on_recovery_end(self, t: float, f: dict[str, Any]) -> None:
        self._recovery_done = True
        if f["restored_step"] is None:  # a plain script resumed at a step it did not say
            return
        restored = int(f["restored_step"])
        while self._batches and self._batches[-1][1] > restored:  # rolled back: lost
            a, b, busy = self._batches.pop()
            gone = b - max(a, restored + 1) + 1
            self.lost_steps += gone
            self.lost_s += busy * gone / (b - a + 1)
            if a <= restored:
                self._batches.append((a, restored, busy * (restored - a + 1) / (b - a + 1)))
                break
        self.step = restored

    def _on_snapshot(self, t: float, f: dict[str, Any]) -> None:
        if int(f["step"]) not in self._snapshot_steps:  # every rank may report it
            self._snapshot_steps.append(int(f["step"]))
            self.checkpoints += 1
            self.stall_s += float(f["stall_s"])

    def _on_persist_end(self, t: float, f: dict[str, Any]) -> None:
        if f["ok"]:
            self.persists_ok += 1
            self.persisted_bytes += int(f.get("bytes_written", 0))
        else:
            self.persists_failed += 1
        self.persist_s += float(f["seconds"])

    def _on_restore(self, t: float, f: dict[str, Any]) -> None:
        self.restores += 1
        self.restore_s += float(f["seconds"])

    def _on_straggler(self, t: float, f: dict[str, Any]) -> None:
        self.stragglers += 1

    def _on_probe(self, t: float, f: dict[str, Any]) -> None:
        if f.get("skipped", False):
            return  # a probe that cannot run here has no reading
        raw = f.get("domain")
        dom: dict[str, Any] = raw if isinstance(raw, dict) else {}
        dev = dom.get("device")
        key = (str(dom.get("node", "")), str(f["probe"]), "" if dev is None else str(dev))
        ok = 1 if f["ok"] else 0
        if not ok and self._probes.get(key) != 0:
            self.probe_failures += 1
        self._probes[key] = ok

    def _on_preflight(self, t: float, f: dict[str, Any]) -> None:
        member = str(f["member"])  # "node<k>": labelled k, as the probes' node label is
        self._preflight[member.removeprefix("node")] = 1 if f["ok"] else 0
        if "seconds" in f:
            self.preflight_s = float(f["seconds"])

    def _on_sdc_check(self, t: float, f: dict[str, Any]) -> None:
        self.sdc_checks += 1
        self.sdc_last_check_step = int(f["step"])

    def _on_sdc_detected(self, t: float, f: dict[str, Any]) -> None:
        self.sdc_detections += 1

    def _on_numeric_fault(self, t: float, f: dict[str, Any]) -> None:
        # under `report` every rank that saw it writes one: counted once
        self._numeric.add((int(f["step"]), str(f["action"]), int(f.get("restored_step", -1))))

    def snapshot(self, now: float | None = None) -> LiveSnapshot:
        """Figures as of ``now`` (default: the latest event's time; pass ``time.time()``
        for a display that keeps ageing while no event arrives)."""
        t = now if now is not None else (self.t_last or 0.0)
        elapsed = max(t - self.t_start, 0.0) if self.t_start is not None else 0.0
        rate = None
        if self._recent:
            span = self._recent[-1][1] - self._recent[0][0]
            rate = sum(n for _, _, n in self._recent) / span if span > 0 else None
        prod = self.busy_s - self.lost_s
        return LiveSnapshot(
            t,
            elapsed,
            self.status,
            self.step,
            self.steps_total,
            rate,
            self.busy_s,
            self.lost_s,
            self.lost_steps,
            prod / elapsed if elapsed > 0 else None,
            self.incidents,
            self.last_rto_s,
            self.last_detection_s,
            self.world_size,
            self.generation,
            self.checkpoints,
            self.stall_s,
            self.persists_ok,
            self.persists_failed,
            self.persist_s,
            self.persisted_bytes,
            self.restores,
            self.restore_s,
            self.stragglers,
            tuple((*k, v) for k, v in sorted(self._probes.items())),
            self.probe_failures,
            self.preflight_s,
            tuple(sorted(self._preflight.items())),
            self.sdc_checks,
            self.sdc_detections,
            len(self._numeric),
            self.sdc_last_check_step,
        )
