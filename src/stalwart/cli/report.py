"""``stalwart report RUN_DIR``: goodput, RTO, MTBF and checkpoint figures of a run.

Why the terminal summary, the JSON and the HTML come from one document: they must never
disagree; scripts read ``--json``, people read the summary and the HTML.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from stalwart.errors import ConfigError

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``report`` to the ``stalwart`` command."""
    p = subparsers.add_parser(
        "report",
        help="goodput/ETTR, badput buckets, RTO, MTBF, checkpoint overhead of a run (HTML, JSON)",
        description=(
            "Figures of a run, computed from RUN_DIR/events.jsonl alone: ETTR and where the "
            "rest of the wall time went, RTO per incident, detection latency, MTBF, "
            "checkpoint overhead and lost work. Definitions: docs/goodput.md. A log that does "
            "not show a whole run gives a report marked PARTIAL."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory of a `stalwart run`")
    p.add_argument(
        "--reference",
        metavar="RUN_DIR",
        help="a run to compare the loss curve against (elastic convergence)",
    )
    p.add_argument("--json", action="store_true", help="print the JSON document, not the summary")
    p.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML report")
    p.add_argument(
        "--band",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="relative band around the reference loss counted as converged (default 0.05)",
    )
    p.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from stalwart.metrics.report import format_summary, load_run

    if not 0 < args.band < 1:
        raise ConfigError(f"--band must be a fraction in (0, 1), got {args.band}")
    rep = load_run(args.run_dir, reference=args.reference, rel_band=args.band)
    doc = rep.to_dict()
    if args.html:
        from stalwart.metrics.html import render_html

        try:
            # O_NONBLOCK: a FIFO no one reads is refused (ENXIO), not waited on forever
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(args.html, flags, 0o666)  # (the umask applies, as before)
            os.set_blocking(fd, True)
            with open(fd, "w", encoding="utf-8") as f:
                f.write(render_html(doc))
        except OSError as err:
            raise ConfigError(
                f"cannot write {args.html}: {err.strerror}; pass a writable --html path"
            ) from err
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_summary(doc))
        if args.html:
            print(f"wrote {args.html}")
    return 0
