"""The report's integrity section: the DDP replica digest checks (``sdc_check`` for each
one every replica passed, ``sdc_detected`` for each mismatch) and the numerical faults
(``numeric_fault``: a NaN/inf or spiking logged loss) with what was done about each
(runtime/integrity/_checks.py; docs/detection.md).

Why the passed checks are counted: "no silent data corruption found" means something
only beside how many checks ran and up to which step; a run with the checks off (or a
sharded job, whose shards are no replicas) says so instead of showing an empty table.
A ``numeric_fault`` under ``report`` is written by each rank that saw it; the rows keep
one per (step, action), with every rank named.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from stalwart.metrics.events import Event

__all__ = ["integrity_html", "integrity_lines", "integrity_section"]


def integrity_section(events: Sequence[Event], t0: float) -> dict[str, Any]:
    checks = [e for e in events if e.kind == "sdc_check"]
    detections = [
        {
            "t": e.t - t0,
            "step": e["step"],
            "detected_step": e["detected_step"],
            "ranks": list(e["ranks"]),
            "action": e["action"],
            "verified_step": e.get("verified_step", -1),
        }
        for e in events
        if e.kind == "sdc_detected"
    ]
    return {
        "checks": len(checks),
        "last_check_step": max((int(e["step"]) for e in checks), default=None),
        "replicas": checks[-1].get("replicas") if checks else None,
        "sdc": detections,
        "numeric": _numeric(events, t0),
    }


def _numeric(events: Sequence[Event], t0: float) -> list[dict[str, Any]]:
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        if e.kind != "numeric_fault":
            continue
        key = (e["step"], e["action"], e.get("restored_step", -1))
        row = rows.get(key)
        if row is not None:  # `report`: the same fault from another rank
            row["ranks"] = sorted({*row["ranks"], *e["ranks"]})
            continue
        rows[key] = {
            "t": e.t - t0,
            "step": e["step"],
            "reason": e["reason"],
            "ranks": sorted(e["ranks"]),
            "action": e["action"],
            "restored_step": e.get("restored_step", -1),
            "skipped_step": e.get("skipped_step", -1),
            "value": e.get("value"),
            "z": e.get("z"),
        }
    return list(rows.values())


def _step(x: Any) -> str:
    return "-" if not isinstance(x, int) or x < 0 else str(x)


def _checks_text(d: dict[str, Any]) -> str:
    if not d.get("checks"):
        return (
            "no replica digest check ran (--sdc-every 0, a single replica, or a sharded "
            "job: FSDP2 shards are not replicas)"
        )
    return (
        f"{d['checks']} replica digest checks passed (the last at step {d['last_check_step']}, "
        f"{d['replicas']} replicas)"
    )


def integrity_lines(d: dict[str, Any]) -> list[str]:
    """The terminal summary's lines (control characters are escaped by the caller)."""
    if not d:
        return []
    out = [f"  integrity: {_checks_text(d)}"] if d.get("checks") or d.get("sdc") else []
    out += [
        f"  sdc: replica digests of step {r['step']} differed (ranks {r['ranks']}) at step "
        f"{r['detected_step']}, {r['t']:.1f}s: {r['action']}"
        + (f" to step {r['verified_step']}" if r["verified_step"] >= 0 else "")
        for r in d.get("sdc", [])
    ]
    out += [
        f"  numeric: {r['reason']} loss at step {r['step']} (ranks {r['ranks']}), "
        f"{r['t']:.1f}s: {r['action']}"
        + (f" to step {r['restored_step']}" if r["restored_step"] >= 0 else "")
        + (f", step {r['skipped_step']} skipped" if r["skipped_step"] >= 0 else "")
        for r in d.get("numeric", [])
    ]
    return out


def _table(ident: str, cols: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return f'<table id="{ident}"><tr>{th}</tr>{body}</table>'


def integrity_html(d: dict[str, Any]) -> str:
    """The HTML section (its heading included)."""
    head = "<h2>Silent data corruption and numerical faults</h2>"
    parts = [head, f"<p>{html.escape(_checks_text(d).capitalize())}.</p>"]
    if d.get("sdc"):
        cols = ["at (s)", "check step", "seen at step", "ranks", "action", "rolled back to"]
        rows = [
            [f"{r['t']:.2f}", str(r["step"]), str(r["detected_step"]),
             ", ".join(map(str, r["ranks"])), str(r["action"]), _step(r["verified_step"])]
            for r in d["sdc"]
        ]  # fmt: skip
        parts.append(_table("sdc", cols, rows))
    else:
        parts.append("<p>No replica digest differed.</p>")
    if d.get("numeric"):
        cols = ["at (s)", "step", "reason", "ranks", "action", "restored", "skipped", "value", "z"]
        rows = [
            [f"{r['t']:.2f}", str(r["step"]), str(r["reason"]), ", ".join(map(str, r["ranks"])),
             str(r["action"]), _step(r["restored_step"]), _step(r["skipped_step"]),
             "-" if r["value"] is None else f"{r['value']:.4g}",
             "-" if r["z"] is None else f"{r['z']:.1f}"]
            for r in d["numeric"]
        ]  # fmt: skip
        parts.append(_table("numeric", cols, rows))
    else:
        parts.append("<p>No NaN, inf or loss spike in the logged values.</p>")
    return "".join(parts)
