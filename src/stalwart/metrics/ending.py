"""The few lines ``stalwart run`` prints when the job has ended: its status, how far it
trained, the faults it met and recovered from, ETTR, and where the run directory and its
report are (a newcomer otherwise finds ``runs/job-<id>`` by chance). A run that did not
end ok has had its verdict printed once, by the agent, just above these lines: the
summary does not repeat it (a verdict printed twice reads as two failures).

Computed from ``RUN_DIR/events.jsonl`` alone, by the same code as ``stalwart report``
(metrics/report.py), so the two never disagree."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from typing import Any

from stalwart.logs import terminal_safe

__all__ = ["end_lines", "format_end", "print_end"]


def end_lines(run_dir: str) -> list[str]:
    """The end-of-run summary of the run in ``run_dir`` (raises ``ReportError`` when it
    has no usable event log)."""
    from stalwart.metrics.report import load_run

    rep = load_run(run_dir)
    return format_end(rep.to_dict())


def print_end(run_dir: str) -> None:
    """The summary on stderr (``stalwart: ...`` lines); nothing when the run left no
    usable event log (a failed start): a summary never changes how a run ends."""
    with contextlib.suppress(Exception):
        for line in end_lines(run_dir):
            print(f"stalwart: {line}", file=sys.stderr, flush=True)


def format_end(d: dict[str, Any]) -> list[str]:
    """The summary lines of a report document (``RunReport.to_dict``)."""
    status = d.get("status") or "unknown (no run_end)"
    steps = d["steps"]
    last = steps.get("last")
    incidents = d.get("incidents", [])
    recovered = sum(1 for i in incidents if i.get("rto_s") is not None)
    rto = d.get("rto_s", {}).get("p50")
    faults = f"{len(incidents)} fault{'s' * (len(incidents) != 1)}"
    if incidents:
        faults += f" ({recovered} recovered" + (f", RTO p50 {rto:.2f}s)" if rto else ")")
    ettr = d.get("ettr")
    ettr_text = "-" if ettr is None else f"{100 * ettr:.1f}%"
    run_dir = _shown(str(d["run_dir"]))
    quoted = shlex.quote(run_dir)
    trained = "no step recorded" if last is None else f"trained to step {last}"
    lines = [
        f"run {status}: {trained}, {faults}, ETTR {ettr_text}, wall {d['wall_s']:.1f}s",
        f"run dir {run_dir} (events.jsonl, logs, checkpoints); report: stalwart report "
        f"{quoted} (--html {shlex.quote(os.path.join(run_dir, 'report.html'))})",
    ]
    return [terminal_safe(line) for line in lines]


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if rel.startswith("..") else rel
