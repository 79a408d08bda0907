"""Regression check (issue 34): compare a new bench JSON line with an older one and flag
every figure whose median moved outside the older run's spread (its min..max).

    python bench/regress.py OLD.json NEW.json [--slack 0.0]

Each file holds a bench's final JSON line (bench/_harness.py: ``spread`` per figure) or a
file of them (bench/report.py's results, ``{"benches": {name: line}}``). Prints one line
per figure moved (``name: figure median OLD [min..max] -> NEW``) and one summary line;
exits 1 when a figure moved, 0 when none did, 2 when a file is not a bench result.
A figure measured once (a quick run: min = max) moves on any change: ``--slack F``
widens the old range by F x its median either way. A figure invalid in either run is
not compared (listed as skipped).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Moved", "load", "moved"]


class NotABenchResultError(ValueError):
    """The file holds no bench JSON line with a ``spread``."""


Moved = tuple[str, str, dict[str, Any], float]  # bench, figure, old spread, new median


def load(path: str | Path) -> dict[str, dict[str, Any]]:
    """{bench name: its final JSON line} from a report's results file, or ``{"bench":
    line}`` from one bench's output."""
    text = Path(path).read_text().strip()
    try:  # a whole JSON file (bench/results/*.json, written indented), else a bench's
        doc = json.loads(text)  # output whose last line is its JSON line
    except json.JSONDecodeError:
        doc = None
    try:
        doc = doc if doc is not None else json.loads(text.splitlines()[-1] if text else "")
    except json.JSONDecodeError as err:
        raise NotABenchResultError(
            f"{path}: its last line is not JSON ({err}); give a bench's output or "
            "bench/results/*.json"
        ) from err
    if isinstance(doc, dict) and isinstance(doc.get("benches"), dict):
        return {str(k): v for k, v in doc["benches"].items() if isinstance(v, dict)}
    if isinstance(doc, dict) and isinstance(doc.get("spread"), dict):
        return {"bench": doc}  # a bare line: compared with the other file's bare line
    raise NotABenchResultError(
        f"{path}: no 'spread' in it: a bench line from before the harness (issue 34)? "
        "rerun the bench"
    )


def moved(
    old: Mapping[str, dict[str, Any]], new: Mapping[str, dict[str, Any]], slack: float = 0.0
) -> tuple[list[Moved], list[str]]:
    """(figures whose new median left the old range widened by ``slack``, figures skipped
    as invalid in either run)."""
    out: list[Moved] = []
    skipped: list[str] = []
    for bench, doc in new.items():
        before = old.get(bench, {}).get("spread", {})
        for fig, spread in doc.get("spread", {}).items():
            was = before.get(fig)
            if was is None:
                continue
            if not (was.get("valid", True) and spread.get("valid", True)):
                skipped.append(f"{bench}: {fig}")
                continue
            pad = slack * abs(float(was["median"]))
            if not float(was["min"]) - pad <= float(spread["median"]) <= float(was["max"]) + pad:
                out.append((bench, fig, was, float(spread["median"])))
    return out, skipped


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--slack", type=float, default=0.0, help="widen the old range by F x median")
    args = p.parse_args(argv)
    try:
        found, skipped = moved(load(args.old), load(args.new), args.slack)
    except (NotABenchResultError, OSError) as err:
        print(f"bench/regress.py: {err}")
        return 2
    for bench, fig, was, now in found:
        print(
            f"{bench}: {fig} median {was['median']:.4g} [{was['min']:.4g}..{was['max']:.4g}]"
            f" -> {now:.4g}"
        )
    print(f"{len(found)} figure(s) moved outside the old spread, {len(skipped)} skipped (invalid)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
