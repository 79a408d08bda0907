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
    from matplotlib.axes import Axes
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


_MAX_BATCHES = 1000  # above this, throughput is drawn in time bins
_MAX_SEGMENTS = 1500  # above this, the bucket strip is drawn as this many columns
_MAX_POINTS = 2000  # loss points drawn at most (every k-th beyond)


def _binned_rate(windows: list[list[Any]], wall: float, n: int) -> tuple[list[float], list[float]]:
    """Steps per second in ``n`` equal time bins: a batch's steps spread over its span."""
    width = wall / n
    done = [0.0] * n
    for t0, t1, steps, _good, _ws in windows:
        span = max(t1 - t0, 1e-12)
        i = max(int(t0 // width), 0)
        while i < n and i * width < t1:
            lo, hi = max(t0, i * width), min(t1, (i + 1) * width)
            if hi > lo:
                done[i] += steps * (hi - lo) / span
            i += 1
    xs: list[float] = []
    ys: list[float] = []
    for i, v in enumerate(done):
        xs += [i * width, (i + 1) * width]
        ys += [v / width, v / width]
    return xs, ys


def _columns(segments: list[list[Any]], wall: float, n: int) -> list[list[Any]]:
    """The bucket strip as ``n`` columns, each showing its dominant bucket; runs of one
    bucket merged. Why: a long run has more segments than the plot has pixels."""
    width = wall / n
    share: list[dict[str, float]] = [{} for _ in range(n)]
    for a, b, name in segments:
        i = max(int(a // width), 0)
        while i < n and i * width < b:
            lo, hi = max(a, i * width), min(b, (i + 1) * width)
            if hi > lo:
                share[i][name] = share[i].get(name, 0.0) + hi - lo
            i += 1
    out: list[list[Any]] = []
    for i, col in enumerate(share):
        if not col:
            continue
        name = max(col, key=lambda k: col[k])
        if out and out[-1][2] == name and out[-1][1] == i * width:
            out[-1][1] = (i + 1) * width
        else:
            out.append([i * width, (i + 1) * width, name])
    return out


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
    wall = max(d["wall_s"], 1e-9)
    if len(s["windows"]) > _MAX_BATCHES:
        xs, ys = _binned_rate(s["windows"], wall, _MAX_BATCHES // 2)
    else:
        for t0, t1, n, _good, _ws in s["windows"]:
            rate = n / (t1 - t0) if t1 > t0 else 0.0
            xs += [t0, t1, t1]
            ys += [rate, rate, float("nan")]
    ax.plot(xs, ys, color=COLORS["productive"], linewidth=1.5, label="steps/s")
    _incidents(ax, d)
    # One artist however many checkpoints: a rug along the bottom, one tick per column.
    col = wall / (4 * _MAX_SEGMENTS)
    ticks = sorted({round(t / col) * col for t in s["snapshots"]})
    if ticks:
        ax.plot(
            ticks,
            [0.0] * len(ticks),
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
    _world_sizes(ax, d["world_size"], wall)
    top = max((y for y in ys if y == y), default=0.0)  # y == y: not NaN
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.set_title("throughput (red: incidents, fault to resume; ticks: checkpoints)", fontsize=9)
    _bucket_strip(strip, s["segments"], d["wall_s"])
    return _svg(fig)


def _incidents(ax: Axes, d: dict[str, Any]) -> None:
    """Each interrupting incident shaded from its fault to its resume, labelled unless
    there are too many to read."""
    for i in d["incidents"]:
        if not i["interrupted"]:
            continue
        end = i["t_resume"] if i["t_resume"] is not None else d["wall_s"]
        ax.axvspan(i["t_fault"], end, color=COLORS["lost_progress"], alpha=0.18, linewidth=0)
        ax.axvline(i["t_fault"], color=COLORS["lost_progress"], linewidth=1)
        if len(d["incidents"]) > 20:
            continue  # labels would overlap; the incident table names them
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


def _world_sizes(ax: Axes, sizes: list[dict[str, Any]], wall: float) -> None:
    """Under elastic (the size changed), the world size on a second axis, dashed."""
    if len({w["world_size"] for w in sizes}) <= 1:
        return
    ws = ax.twinx()
    ws.step(
        [w["t"] for w in sizes] + [wall],
        [w["world_size"] for w in sizes] + [sizes[-1]["world_size"]],
        where="post",
        color="black",
        linewidth=0.8,
        linestyle="--",
    )
    ws.set_ylabel("world size (dashed)")
    ws.set_ylim(0, max(w["world_size"] for w in sizes) * 1.15)


def _bucket_strip(strip: Axes, segs: list[list[Any]], wall_s: float) -> None:
    """The strip of which bucket every instant went to, its legend below."""
    if len(segs) > _MAX_SEGMENTS:
        segs = _columns(segs, max(wall_s, 1e-9), _MAX_SEGMENTS)
    for name in COLORS:
        spans = [(a, b - a) for a, b, k in segs if k == name]
        if spans:
            strip.broken_barh(spans, (0, 1), color=COLORS[name], label=name)
    strip.set_yticks([])
    strip.set_xlim(0, max(wall_s, 1e-9))
    strip.set_xlabel("seconds since run start")
    strip.legend(loc="upper center", bbox_to_anchor=(0.5, -0.9), ncol=5, fontsize=7, frameon=False)


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
        ref = s["reference_loss"][:: max(1, len(s["reference_loss"]) // _MAX_POINTS)]
        rs, rv = zip(*ref, strict=True)
        ax.plot(rs, rv, color="black", linewidth=1, label="reference")
    pts = s["loss"][:: max(1, len(s["loss"]) // _MAX_POINTS)]
    if pts:
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
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
