"""Detection breadth: stragglers, health probes and preflight, silent data corruption and
numerical faults, each measured against a fault-free run of the same job. Prints one line
per part and a final JSON line with every part's figures.

Each part is a module ``bench/_detect_<part>.py`` with ``add_arguments(parser)`` and
``measure(args, work) -> dict``; this file finds them, runs the ones asked for
(``--parts``, default all) in order, each in a fresh working directory, and merges their
figures. A part that cannot run here (a package missing, no GPU) returns ``{"<part>_note":
"why"}`` instead of figures, so the JSON line always says what was and was not measured.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent


def _parts() -> dict[str, ModuleType]:
    sys.path.insert(0, str(HERE))
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
    args = p.parse_args()
    wanted = [x for x in args.parts.split(",") if x]
    unknown = [x for x in wanted if x not in parts]
    if unknown:
        print(f"bench/detection.py: unknown part(s) {unknown}; known: {sorted(parts)}")
        return 2
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-detect-") as tmp:
        for name in wanted:
            work = Path(tmp) / name
            work.mkdir()
            t0 = time.monotonic()
            figures = parts[name].measure(args, work)
            print(f"{name}: {json.dumps(figures)} ({time.monotonic() - t0:.0f} s)", flush=True)
            result.update(figures)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
