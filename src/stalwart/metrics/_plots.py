"""The report's plots as SVG documents (matplotlib's SVG canvas, no pyplot).

matplotlib is imported inside the functions, so importing :mod:`stalwart.metrics`
selects no backend and stays cheap; Figure + FigureCanvasSVG touch no global state.
Each plot reads only the report's JSON document, so the HTML can never show numbers the
JSON does not have.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLORS: dict[str, str] = {
    "productive": "#2ca02c",
    "startup": "#9467bd",
    "checkpoint_stall": "#1f77b4",
    "restore": "#17becf",
    "lost_progress": "#d62728",
    "detection": "#ff7f0e",
    "recovery": "#e377c2",
    "waiting": "#bcbd22",
    "other": "#7f7f7f",
}


def _svg(fig: Figure) -> str:
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    FigureCanvasSVG(fig)
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()


def timeline(d: dict[str, Any]) -> str:
    """Throughput over time with incidents shaded and checkpoints ticked, above a strip
    that shows which bucket every instant of the run went to."""
    from matplotlib.figure import Figure

    s = d["series"]
    fig = Figure(figsize=(9.0, 4.6), layout="constrained")
    ax, strip = fig.subplots(2, 1, sharex=True, height_ratios=[4, 1])
    xs: list[float] = []
    ys: list[float] = []
    for t0, t1, n, _good, _ws in s["windows"]:
        rate = n / (t1 - t0) if t1 > t0 else 0.0
        xs += [t0, t1, t1]
        ys += [rate, rate, float("nan")]
    ax.plot(xs, ys, color=COLORS["productive"], linewidth=1.5, label="steps/s")
    for i in d["incidents"]:
        if not i["interrupted"]:
            continue
        end = i["t_resume"] if i["t_resume"] is not None else d["wall_s"]
        ax.axvspan(i["t_fault"], end, color=COLORS["lost_progress"], alpha=0.18, linewidth=0)
        ax.axvline(i["t_fault"], color=COLORS["lost_progress"], linewidth=1)
        ax.annotate(
            f"#{i['index']} {i['fault']}",
            (i["t_fault"], 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            rotation=90,
            va="top",
            ha="right",
            color=COLORS["lost_progress"],
        )
    if s["snapshots"]:  # one artist however many checkpoints: a rug along the bottom
        ax.plot(
            sorted(set(s["snapshots"])),
            [0.0] * len(set(s["snapshots"])),
            "|",
            color=COLORS["checkpoint_stall"],
            markersize=10,
            clip_on=False,
            label="checkpoints",
        )
    for r in d["resumes"]:
        if r["cause"] == "reconfiguration":
            ax.axvline(r["t"], color=COLORS["recovery"], linewidth=1, linestyle="--")
    ax.set_ylabel("steps / s")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput (red: incidents, fault to resume; ticks: checkpoints)", fontsize=9)
    for name in COLORS:
        spans = [(a, b - a) for a, b, k in s["segments"] if k == name]
        if spans:
            strip.broken_barh(spans, (0, 1), color=COLORS[name], label=name)
    strip.set_yticks([])
    strip.set_xlim(0, max(d["wall_s"], 1e-9))
    strip.set_xlabel("seconds since run start")
    strip.legend(loc="upper center", bbox_to_anchor=(0.5, -0.9), ncol=5, fontsize=7, frameon=False)
    return _svg(fig)


def badput(d: dict[str, Any]) -> str:
    """Wall time by bucket, largest first; productive time included for scale."""
    from matplotlib.figure import Figure

    items = sorted(d["buckets_s"].items(), key=lambda kv: kv[1])
    fig = Figure(figsize=(6.0, 3.4), layout="constrained")
    ax = fig.add_subplot()
    names = [k for k, _ in items]
    vals = [v for _, v in items]
    ax.barh(names, vals, color=[COLORS[k] for k in names])
    wall = d["wall_s"] or 1.0
    for y, v in enumerate(vals):
        ax.annotate(f" {v:.1f}s ({100 * v / wall:.1f}%)", (v, y), va="center", fontsize=8)
    ax.set_xlabel("seconds of wall time")
    ax.set_xlim(0, max([*vals, 1e-9]) * 1.35)
    ax.set_title("where the wall time went", fontsize=9)
    return _svg(fig)


def rto(d: dict[str, Any]) -> str:
    """Per incident: detection latency, then the rest of the time to resume."""
    from matplotlib.figure import Figure

    incs = [i for i in d["incidents"] if i["interrupted"]]
    fig = Figure(figsize=(6.0, 3.4), layout="constrained")
    ax = fig.add_subplot()
    labels = [f"#{i['index']} {i['fault']}" for i in incs]
    det = [i["detection_latency_s"] or 0.0 for i in incs]
    rest = [max((i["rto_s"] or 0.0) - x, 0.0) for i, x in zip(incs, det, strict=True)]
    ax.bar(labels, det, color=COLORS["detection"], label="detection")
    ax.bar(labels, rest, bottom=det, color=COLORS["recovery"], label="recovery to first step")
    r = d["rto_s"]
    for q, style in (("p50", "-"), ("p95", "--")):
        if r[q] is not None:
            ax.axhline(r[q], color="black", linewidth=0.8, linestyle=style, label=f"RTO {q}")
    if not incs:
        ax.text(0.5, 0.5, "no failures", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("seconds")
    ax.set_title("recovery time per incident (fault to first step after it)", fontsize=9)
    ax.legend(fontsize=7)
    return _svg(fig)


def loss(d: dict[str, Any]) -> str:
    """The run's loss by step (every value logged, redone steps included) against the
    reference's curve, with each resumption marked."""
    from matplotlib.figure import Figure

    s = d["series"]
    fig = Figure(figsize=(7.0, 3.6), layout="constrained")
    ax = fig.add_subplot()
    if s["reference_loss"]:
        rs, rv = zip(*s["reference_loss"], strict=True)
        ax.plot(rs, rv, color="black", linewidth=1, label="reference")
    if s["loss"]:
        ax.plot(
            [p[0] for p in s["loss"]],
            [p[1] for p in s["loss"]],
            ".",
            color=COLORS["productive"],
            markersize=3,
            label="this run",
        )
    for r in d["resumes"]:
        ax.axvline(r["step"], color=COLORS["recovery"], linewidth=0.8, linestyle="--")
    ax.set_xlabel("step (dashed: resumptions)")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    return _svg(fig)
