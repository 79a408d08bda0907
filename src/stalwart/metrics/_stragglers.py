"""The report's straggler section: every ``straggler`` event (agent/detection/stragglers.py) as a
row, for the JSON document, the terminal summary and the HTML report.

A straggler is not a failure: under ``--on-straggler report`` the job never stopped for
it, so it is listed here and as an incident "no interruption", never in MTBF or RTO.
Under ``evict`` the rank's replacement is a recovery like any other (its incident row
has the RTO).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from stalwart.metrics.events import Event

__all__ = ["straggler_html", "straggler_lines", "straggler_rows"]


def straggler_rows(events: Sequence[Event], t0: float) -> list[dict[str, Any]]:
    """One row per ``straggler`` event; ``t`` relative to the run's start."""
    return [
        {
            "t": e.t - t0,
            "rank": e["domain"].get("rank"),
            "node": e["domain"].get("node"),
            "compute_s": e["compute_s"],
            "median_s": e["median_s"],
            "ratio": e.get("ratio"),
            "score": e["score"],
            "windows": e["windows"],
            "action": e["action"],
            "latency_s": e.get("latency_s"),
        }
        for e in events
        if e.kind == "straggler" and isinstance(e["domain"], dict)
    ]


def _ms(x: Any) -> str:
    return "-" if not isinstance(x, int | float) else f"{1000 * x:.1f} ms"


def _num(x: Any, fmt: str) -> str:
    return "-" if not isinstance(x, int | float) else format(x, fmt)


def straggler_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The terminal summary's lines (control characters are escaped by the caller)."""
    return [
        f"  straggler: rank {r['rank']} (node {r['node']}) at {r['t']:.1f}s computes "
        f"{_ms(r['compute_s'])}/step, {_num(r['ratio'], '.2f')}x the others' median "
        f"{_ms(r['median_s'])} (z {_num(r['score'], '.1f')}, {r['windows']} windows), "
        f"detected {_num(r['latency_s'], '.1f')}s, {r['action']}"
        for r in rows
    ]


def straggler_html(rows: list[dict[str, Any]]) -> str:
    """The HTML section (its heading included)."""
    head = "<h2>Stragglers</h2>"
    if not rows:
        return head + (
            "<p>No straggler: no rank computed persistently slower than the others "
            "(compute time: step time outside collectives and pauses).</p>"
        )
    cols = ["at (s)", "rank", "node", "compute / step", "others' median", "ratio",
            "robust z", "windows", "detected after (s)", "action"]  # fmt: skip
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _cells(r)) + "</tr>"
                   for r in rows)  # fmt: skip
    th = "".join(f"<th>{c}</th>" for c in cols)
    return f'{head}<table id="stragglers"><tr>{th}</tr>{body}</table>'


def _cells(r: dict[str, Any]) -> list[str]:
    return [
        _num(r["t"], ".2f"), str(r["rank"]), str(r["node"]), _ms(r["compute_s"]),
        _ms(r["median_s"]), _num(r["ratio"], ".2f"), _num(r["score"], ".1f"),
        str(r["windows"]), _num(r["latency_s"], ".1f"), str(r["action"]),
    ]  # fmt: skip
