"""Interval operations against brute force, and the plots' downsampling of long runs."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path
from typing import Any

from stalwart.cli.main import main
from stalwart.metrics import _plots
from stalwart.metrics.intervals import add, covers, measure, overlapping, union


def test_interval_ops_match_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(500):
        merged: list[tuple[float, float]] = []
        raw: list[tuple[float, float]] = []
        for _ in range(rng.randint(1, 10)):
            a = float(rng.randint(0, 30))
            b = a + rng.randint(0, 8)
            before = measure(union(raw), a, b)
            assert add(merged, a, b) == before
            raw.append((a, b))
            assert merged == union(raw)
        ref = union(raw)
        for x in range(40):
            inside = any(p <= x + 0.5 < q for p, q in ref)
            assert covers(merged, x, x + 1) == inside
            lo, hi = float(x), float(x + rng.randint(1, 6))
            assert overlapping(merged, lo, hi) == [(p, q) for p, q in ref if p < hi and q > lo]


def test_binned_throughput_conserves_steps() -> None:
    windows: list[list[Any]] = [[i * 1.5, i * 1.5 + 1.0, 10, 10, 4] for i in range(3000)]
    wall = 3000 * 1.5
    xs, ys = _plots._binned_rate(windows, wall, 500)
    width = wall / 500
    assert math.isclose(sum(y * width for y in ys[::2]), 30_000, rel_tol=1e-9)
    assert xs[0] == 0 and math.isclose(xs[-1], wall)


def test_strip_columns_cover_the_run_once() -> None:
    segs: list[list[Any]] = []
    for i in range(4000):
        segs += [[i * 1.0, i + 0.9, "productive"], [i + 0.9, i + 1.0, "other"]]
    segs.append([4000.0, 4100.0, "recovery"])
    cols = _plots._columns(segs, 4100.0, 1500)
    assert cols[0][0] == 0 and math.isclose(cols[-1][1], 4100.0)
    assert all(math.isclose(a[1], b[0]) for a, b in itertools.pairwise(cols))
    assert {c[2] for c in cols} == {"productive", "recovery"}  # "other" never dominates


def test_long_run_html_stays_small(synth: Any, tmp_path: Path) -> None:
    synth.start(0.0)
    for i in range(3000):
        synth.steps(i * 1.0, i + 0.9, 10 * i + 1, 10 * i + 10, 0.85)
        synth.snapshot(i + 0.95, 10 * i + 10, 0.05)
        synth.emit("loss", i + 0.9, step=10 * i + 10, value=1.0 / (i + 1))
    run = synth.end(3000.0).close()
    out = tmp_path / "big.html"
    assert main(["report", str(run), "--html", str(out)]) == 0
    page = out.read_text()
    assert page.count("data:image/svg+xml;base64,") == 4
    assert len(page) < 3_000_000, len(page)  # every batch drawn would be ~10x that
