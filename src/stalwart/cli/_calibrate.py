"""``stalwart calibrate RUN_DIR``: measure a run's costs from its event log, write a
calibration file for ``stalwart plan|simulate --calibration``, and replay the run in the
simulator (predicted vs measured ETTR)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.cli._sim_text import clean, table
from stalwart.errors import ConfigError

if TYPE_CHECKING:
    from stalwart.sim.calibrate import CalibrationRun
    from stalwart.sim.replay import ReplayResult

__all__ = ["register_calibrate"]


def register_calibrate(subparsers: Any) -> None:
    cal = subparsers.add_parser(
        "calibrate",
        help="measure a run's costs from its event log and write a calibration file",
        description=(
            "Read RUN_DIR/events.jsonl (a `stalwart run`), measure step time, snapshot stall, "
            "persist, detection latency per fault kind, recovery per strategy and restore per "
            "tier, and write a calibration file for `stalwart plan|simulate --calibration`. "
            "Also replays the run in the simulator and prints predicted vs measured ETTR."
        ),
    )
    cal.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or its events.jsonl)")
    cal.add_argument(
        "--out", metavar="FILE", help="where to write it (default RUN_DIR/calibration.json)"
    )
    cal.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    cal.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from stalwart.sim.calibrate import calibrate
    from stalwart.sim.calibration import calibration_to_dict
    from stalwart.sim.replay import replay

    run = calibrate(args.run_dir)
    cal = run.calibration
    doc = calibration_to_dict(cal)
    if args.out:
        out = Path(args.out)
    else:
        base = Path(args.run_dir)
        out = (base if base.is_dir() else base.parent) / "calibration.json"
    _write(out, doc)
    warnings = list(run.warnings)
    if run.missing:
        warnings.append(
            "not measured by this run (the preset's values stay): " + ", ".join(run.missing)
        )
    rep = replay(cal) if cal.replay is not None else None
    if args.json:
        _print_json(out, doc, run, warnings, rep)
    else:
        _print_text(out, run, warnings, rep)
    return 0


def _write(out: Path, doc: dict[str, Any]) -> None:
    """The calibration file, whole or not at all (written aside, then renamed)."""
    import os

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(clean(doc), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except OSError as err:
        raise ConfigError(f"cannot write {out}: {err.strerror}; pass --out FILE") from err


def _print_json(
    out: Path,
    doc: dict[str, Any],
    run: CalibrationRun,
    warnings: list[str],
    rep: ReplayResult | None,
) -> None:
    print(
        json.dumps(
            clean(
                {
                    "file": str(out),
                    "calibration": doc,
                    "samples": {k: run.counts.get(k, 0) for k in run.calibration.costs},
                    "missing": run.missing,
                    "warnings": warnings,
                    "replay": None
                    if rep is None
                    else {
                        "strategy": rep.strategy,
                        "predicted_ettr": rep.predicted_ettr,
                        "measured_ettr": rep.measured_ettr,
                        "error_pp": rep.error_pp,
                        "interval_s": rep.interval_s,
                        "failures": rep.failures,
                    },
                }
            )
        )
    )


def _print_text(
    out: Path, run: CalibrationRun, warnings: list[str], rep: ReplayResult | None
) -> None:
    import sys

    from stalwart.logs import terminal_safe

    cal = run.calibration
    for w in warnings:
        print(f"stalwart: warning: {terminal_safe(w)}", file=sys.stderr)
    m = cal.measured
    head = f"calibrated {cal.source.get('run_dir')} ({cal.source.get('events')} events"
    if m is not None:
        head += (
            f", strategy {cal.source.get('strategy')}, {m.gpus} GPUs on {m.nodes} node(s), "
            f"{m.failures} failure(s), wall {m.wall_s:.1f}s"
        )
    print(terminal_safe(head + ")"))  # run_dir and strategy come from the event log
    rows = [[k, f"{v:.4g}", str(run.counts.get(k, 0))] for k, v in cal.costs.items()]
    if rows:
        print(table(["cost", "seconds", "samples"], rows))
    if m is not None:
        extra = []
        if m.step_s is not None:
            extra.append(f"step {1000 * m.step_s:.1f} ms")
        if m.mtbf_s is not None:
            extra.append(f"MTBF {m.mtbf_s:.1f}s")
        if m.persist_bytes_per_s is not None:
            extra.append(f"persist {m.persist_bytes_per_s / 1e6:.1f} MB/s")
        print(f"measured: ETTR {100 * m.ettr:.1f}%  " + "  ".join(extra))
    if rep is not None:
        pp = rep.error_pp
        print(
            f"replay ({rep.strategy}, {rep.failures} failure(s) at the run's steps/times, "
            f"checkpoint every {rep.interval_s:.3g}s): predicted ETTR "
            f"{100 * rep.predicted_ettr:.1f}%"
            + ("" if pp is None else f" vs measured {100 * (rep.measured_ettr or 0):.1f}%")
            + ("" if pp is None else f" ({pp:+.1f} pp)")
        )
    print(f"wrote {out}")
