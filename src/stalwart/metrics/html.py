"""The self-contained HTML report: one file, no network needed to view it.

Why SVG as ``data:`` images: vector plots stay sharp at any zoom, fonts are drawn as
paths (nothing to fetch), and each plot lives in its own document so element ids from
matplotlib never clash between plots. Numbers come from the report's JSON document, the
same one ``stalwart report --json`` prints.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable
from typing import Any

from stalwart.metrics import _plots
from stalwart.metrics._health import health_html
from stalwart.metrics._integrity import integrity_html
from stalwart.metrics._stragglers import straggler_html
from stalwart.metrics.goodput import BUCKETS
from stalwart.metrics.report import strategy_text

__all__ = ["render_html"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1000px;
color:#222;padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em}td,th{padding:.25em .7em;text-align:right;
border-bottom:1px solid #eee}th{background:#f6f6f6}td:first-child,th:first-child{text-align:left}
.partial{background:#fff3cd;border:1px solid #e0b400;padding:.6em 1em}
.kpi{display:inline-block;margin:0 2em .6em 0}.kpi b{display:block;font-size:1.5em}
img.plot{max-width:100%;display:block;margin:.5em 0}
.swatch{display:inline-block;width:.8em;height:.8em;margin-right:.4em}
"""


def _num(x: Any, fmt: str = ".2f", unit: str = "") -> str:
    if x is None:
        return "&ndash;"
    return html.escape(f"{x:{fmt}}{unit}")


def _img(svg: str, alt: str) -> str:
    data = base64.b64encode(svg.encode()).decode()
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/svg+xml;base64,{data}">'


def _table(head: list[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _plot(fn: Callable[[dict[str, Any]], str], d: dict[str, Any], alt: str) -> str:
    return _img(fn(d), alt)


def render_html(d: dict[str, Any]) -> str:
    """The whole HTML document for a :meth:`RunReport.to_dict` document."""
    e = html.escape
    job = e(str(d["job"] or "-"))
    parts = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        f"<title>stalwart report: {job}</title><style>{_CSS}</style></head><body>",
        f"<h1>stalwart report &mdash; {job}</h1>",
        f"<p>run <code>{e(d['run_dir'])}</code> &middot; strategy {e(strategy_text(d))} "
        f"&middot; status {e(str(d['status'] or 'unknown (no run_end)'))}</p>",
        *_problems(d),
        _kpis(d),
        "<h2>Timeline</h2>" + _plot(_plots.timeline, d, "throughput over time"),
        "<h2>Where the time went</h2>" + _buckets(d),
        _plot(_plots.badput, d, "badput breakdown"),
        "<h2>Incidents</h2>" + _incidents(d),
        _plot(_plots.rto, d, "RTO per incident"),
        straggler_html(d.get("stragglers", [])),
        health_html(d.get("health", {})),
        integrity_html(d.get("integrity", {})),
        _rto_and_mtbf(d),
        "<h2>Checkpoints</h2>" + _checkpoints(d["checkpoint"]),
        *_loss(d),
        '<h2>Raw figures</h2><details><summary>JSON</summary><pre id="json">'
        + e(json.dumps({k: v for k, v in d.items() if k != "series"}, indent=1))
        + "</pre></details></body></html>",
    ]
    return "\n".join(parts)


def _problems(d: dict[str, Any]) -> list[str]:
    """What the event log did not show (a partial report) or looked wrong in it."""
    items = "".join(f"<li>{html.escape(p)}</li>" for p in d["problems"])
    if d["partial"]:
        return [
            f'<div class="partial" id="partial"><b>Partial report.</b> The event log does not '
            f"show a whole run; figures cover what it shows.<ul>{items}</ul></div>"
        ]
    if d["problems"]:
        return [f'<div class="partial" id="warnings"><b>Warnings.</b><ul>{items}</ul></div>']
    return []


def _kpis(d: dict[str, Any]) -> str:
    ettr, m, r, lost = d["ettr"], d["mtbf"], d["rto_s"], d["steps"]["lost"]
    at_most = "&le; " if lost is None else ""  # a plain script's redone steps not known
    kpis = [
        ("ETTR", at_most + _num(None if ettr is None else 100 * ettr, ".1f", "%")),
        ("wall time", _num(d["wall_s"], ".1f", " s")),
        ("productive steps", str(d["steps"]["productive"])),
        ("failures", str(d["failures"])),
        ("RTO p50", _num(r["p50"], ".2f", " s")),
        ("MTBF", _num(m["mtbf_s"], ".0f", " s")),
        (
            "lost work",
            "unknown" if lost is None else f"{lost} steps / {_num(d['lost_work_s'], '.1f', ' s')}",
        ),
    ]
    return "".join(f'<span class="kpi">{k}<b>{v}</b></span>' for k, v in kpis)


def _buckets(d: dict[str, Any]) -> str:
    wall = d["wall_s"]
    rows = [
        [
            f'<span class="swatch" style="background:{_plots.COLORS[k]}"></span>{k}',
            _num(d["buckets_s"][k], ".2f", " s"),
            _num(None if wall <= 0 else 100 * d["buckets_s"][k] / wall, ".2f", " %"),
        ]
        for k in BUCKETS
    ]
    rows.append(
        ["<b>total (= wall time)</b>", _num(sum(d["buckets_s"].values()), ".2f", " s"), "100.00 %"]
    )
    return _table(["bucket", "time", "share"], rows)


def _rto_and_mtbf(d: dict[str, Any]) -> str:
    m, r = d["mtbf"], d["rto_s"]
    return (
        f"<p>RTO p50 {_num(r['p50'])} s, p95 {_num(r['p95'])} s, max {_num(r['max'])} s; "
        f"detection latency p50 {_num(d['detection_latency_s']['p50'])} s. "
        f"MTBF {_num(m['mtbf_s'], '.0f')} s ({100 * m['confidence']:.0f}% interval "
        f"{_num(m['lower_s'], '.0f')} &ndash; "
        f"{_num(m['upper_s'], '.0f') if m['upper_s'] is not None else 'unbounded'} s) "
        f"from {m['failures']} failure(s) in {_num(m['exposure_s'], '.0f')} s.</p>"
    )


def _checkpoints(c: dict[str, Any]) -> str:
    head = [
        "snapshots",
        "stall",
        "stall % of wall",
        "persist (background)",
        "persist % of wall",
        "persist cost % of wall",
        "failed persists",
        "written",
    ]
    row = [
        str(c["snapshots"]),
        _num(c["stall_s"], ".2f", " s"),
        _num(c["stall_pct"]),
        _num(c["persist_s"], ".2f", " s"),
        _num(c["persist_pct"]),
        _num(c["persist_overhead_pct"]),
        str(c["persists_failed"]),
        f"{c['bytes_written']:,} B",
    ]
    return _table(head, [row])


def _loss(d: dict[str, Any]) -> list[str]:
    """The loss plot and, per resumption, how soon the loss was back in the band."""
    if not (d["series"]["loss"] or d["series"]["reference_loss"]):
        return []
    out = ["<h2>Loss</h2>" + _plot(_plots.loss, d, "loss vs reference")]
    conv = [
        [
            str(cv["resume_step"]),
            html.escape(cv["cause"]),
            str(cv["world_size"]),
            str(cv["compared"]),
            "never" if cv["steps_to_converge"] is None else str(cv["steps_to_converge"]),
        ]
        for cv in d["convergence"]
    ]
    if conv:
        head = [
            "resumed at step",
            "cause",
            "world size",
            "losses compared",
            "steps until within band",
        ]
        out.append(_table(head, conv))
    return out


def _incidents(d: dict[str, Any]) -> str:
    if not d["incidents"]:
        return "<p>No incidents: the run never failed.</p>"
    rows = [
        [
            f"#{i['index']}",
            html.escape(f"{i['fault']} {json.dumps(i['domain'])}"),
            "injected" if i["injected"] else "natural",
            _num(i["t_fault"], ".2f", " s"),
            _num(i["detection_latency_s"]),
            _num(i["rto_s"]),
            html.escape(i["strategy"] or "-"),
            "-" if i["restored_step"] is None else str(i["restored_step"]),
            html.escape(i["source_tier"] or "-"),
            ", ".join(
                x
                for x, on in (
                    ("during recovery", i["during_recovery"]),
                    ("overlaps " + ",".join(f"#{o}" for o in i["overlaps"]), bool(i["overlaps"])),
                    ("no interruption", not i["interrupted"]),
                )
                if on
            ),
        ]
        for i in d["incidents"]
    ]
    head = [
        "#",
        "fault",
        "source",
        "at",
        "detected after (s)",
        "RTO (s)",
        "strategy",
        "restored step",
        "tier",
        "notes",
    ]
    return _table(head, rows)
