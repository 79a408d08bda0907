"""Detection breadth: stragglers, health probes and preflight, silent data corruption and
numerical faults, each measured against a fault-free run of the same job. Prints one line
per part and a final JSON line with every part's figures.

Each part is a module ``bench/_detect_<part>.py`` with ``add_arguments(parser)`` and
``measure(args, work) -> dict``; this file finds them, runs the ones asked for
(``--parts``, default all) in order, each in a fresh working directory, and merges their
figures; ``--reps N`` (default 3, bench/_harness.py) runs the parts N times, in an order
reversed every other repetition, and the final line holds each figure's median with its
spread, the straggler detection as a rate (``straggler_detected_1p5x``: "k/n") and
``valid``. A part that cannot run here (a package missing, no GPU) returns ``{"<part>_note":
"why"}`` instead of figures, so the JSON line always says what was and was not measured.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import Summary, add_arguments, interleaved, repeat  # noqa: E402


def _parts() -> dict[str, ModuleType]:
    found: dict[str, ModuleType] = {}
    for path in sorted(HERE.glob("_detect_*.py")):
        name = path.stem.removeprefix("_detect_")
        found[name] = importlib.import_module(path.stem)
    return found


def main() -> int:
    parts = _parts()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--parts",
        default=",".join(parts),
        help=f"comma-separated parts to run (default all: {','.join(parts) or 'none'})",
    )
    for mod in parts.values():
        mod.add_arguments(p)
    add_arguments(p)
    args = p.parse_args()
    wanted = [x for x in args.parts.split(",") if x]
    unknown = [x for x in wanted if x not in parts]
    if unknown:
        print(f"bench/detection.py: unknown part(s) {unknown}; known: {sorted(parts)}")
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-detect-") as tmp:

        def measure(rep: int) -> dict[str, Any]:
            result: dict[str, Any] = {}
            for name in interleaved(wanted, rep):
                work = Path(tmp) / f"{name}.r{rep}"
                work.mkdir()
                t0 = time.monotonic()
                figures = parts[name].measure(args, work)
                print(f"{name}: {json.dumps(figures)} ({time.monotonic() - t0:.0f} s)", flush=True)
                result.update(figures)
            return result

        summary = repeat(measure, args.reps)
    print(json.dumps(summary.document(straggler_rates(summary))))
    return 0


def straggler_rates(summary: Summary) -> dict[str, Any]:
    """Straggler detection as a distribution over the repetitions: the rate found within
    the timeout (k/n; a None latency is a straggler never declared), the latency's p95
    (nearest rank) beside its median, and the false positives per hour of fault-free
    running, pooled over the repetitions."""
    out: dict[str, Any] = {}
    n = len(summary.reps)
    for factor in ("3x", "1p5x"):
        key = f"straggler_detect_s_{factor}"
        if any(key in r.figures for r in summary.reps):
            vals = sorted(summary.values(key))
            out[f"straggler_detected_{factor}"] = f"{len(vals)}/{n}"
            if vals:
                out[f"{key}_p95"] = vals[math.ceil(0.95 * len(vals)) - 1]
    fps, spans = (
        summary.values("straggler_false_positives"),
        summary.values("straggler_fault_free_s"),
    )
    if fps and spans and len(fps) == len(spans) and sum(spans) > 0:
        out["straggler_false_positives_per_hour"] = 3600 * sum(fps) / sum(spans)
    return out


if __name__ == "__main__":
    sys.exit(main())
