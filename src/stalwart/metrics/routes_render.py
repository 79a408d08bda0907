"""``stalwart compare``'s document as Markdown (the seed's table) and as an HTML page with
every route's loss curve on one plot.

Both read only the JSON document (:func:`stalwart.metrics.routes.compare_document`), so the
page and the table never show a number the JSON does not have. matplotlib is imported
inside the plot function (no backend chosen at import, as in the report's plots).
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

__all__ = ["COLUMNS", "routes_html", "routes_markdown"]

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("time_to_target_s", "time to target (s)", ".1f"),
    ("fault_free_s", "fault-free (s)", ".1f"),
    ("ettr", "ETTR", ".3f"),
    ("utilisation", "utilisation", ".3f"),
    ("rto_p50_s", "RTO p50 (s)", ".2f"),
    ("rto_p95_s", "RTO p95 (s)", ".2f"),
    ("struck_back_p50_s", "struck rank back p50 (s)", ".2f"),
    ("steps_lost", "steps lost", "d"),
    ("loss_gap", "loss gap", "+.4f"),
    ("sim_predicted_ettr", "sim ETTR", ".3f"),
    ("sim_measured_ettr", "ETTR (report)", ".3f"),
)
"""(key, header, format) of the table's numeric columns, in order."""


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:{fmt}}"


def _rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, r in doc["routes"].items():
        faults = f"{r['recovered']}/{r['faults']}"
        if not r.get("met_faults", True):
            faults += " (no fault fired)"
        rows.append([name, faults, *(_cell(r.get(k), f) for k, _, f in COLUMNS), r["note"]])
    return rows


def _head() -> list[str]:
    return ["route", "recovered/faults", *(h for _, h, _ in COLUMNS), "note"]


def routes_markdown(doc: dict[str, Any]) -> str:
    """The table, one row per route run and a line per route not run (with why)."""
    job, trace = doc["job"], doc["trace"]
    load = f"; load average {job['load']}" if job.get("load") else ""
    lines = [
        f"# stalwart compare: {job['script']} x {job['workers']} workers to step {job['target']}",
        "",
        f"trace `{trace['spec']}` (seed {trace['seed']}, {len(trace['faults'])} instants "
        f"recorded up to {trace['horizon_s']:.0f} s){load}",
        "",
        "| " + " | ".join(_head()) + " |",
        "|" + "---|" * len(_head()),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(doc)]
    for name, why in doc["absent"].items():
        lines.append(f"| {name} | {why} |" + " |" * (len(_head()) - 2))
    return "\n".join(lines) + "\n"


def _loss_svg(curves: dict[str, list[list[float]]]) -> str:
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for name, pts in curves.items():
        if not pts:
            continue
        style = ":" if name.endswith("/fault-free") else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, linewidth=1, label=name)
    ax.set_xlabel("step (kept attempt of each)")
    ax.set_ylabel("loss (member 0)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    FigureCanvasSVG(fig)
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()


def routes_html(doc: dict[str, Any]) -> str:
    """One self-contained page: the table and the loss curves of every route."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in _head())
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in _rows(doc)
    )
    absent = "".join(
        f"<li>{html.escape(k)}: {html.escape(v)}</li>" for k, v in doc["absent"].items()
    )
    svg = base64.b64encode(_loss_svg(doc["curves"]).encode()).decode()
    job = doc["job"]
    title = html.escape(f"stalwart compare: {job['script']} x {job['workers']} workers")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px}"
        "table{border-collapse:collapse;font-size:.85em}td,th{padding:.25em .6em;"
        "border-bottom:1px solid #eee;text-align:right}td:first-child{text-align:left}"
        "img{max-width:100%}</style></head><body>"
        f"<h1>{title}</h1><p>trace <code>{html.escape(doc['trace']['spec'])}</code></p>"
        f"<table><tr>{head}</tr>{body}</table><ul>{absent}</ul>"
        "<h2>loss curves (dotted: the same route without faults)</h2>"
        f"<img alt='loss curves' src='data:image/svg+xml;base64,{svg}'>"
        "</body></html>\n"
    )
