"""Fault traces: compiled once with a seed, recorded, replayed identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.chaos import parse_spec
from stalwart.chaos.trace import TraceSpecError, compile_trace, load_trace


def test_same_seed_same_instants_other_seed_other() -> None:
    a = compile_trace("kill every=20s; hang every=90s", seed=3, ranks=4, horizon_s=310)
    b = compile_trace("kill every=20s; hang every=90s", seed=3, ranks=4, horizon_s=310)
    c = compile_trace("kill every=20s; hang every=90s", seed=4, ranks=4, horizon_s=310)
    assert a == b
    assert a.faults != c.faults
    assert [f.t_s for f in a.faults] == sorted(f.t_s for f in a.faults)
    kinds = [f.kind for f in a.faults]
    assert kinds.count("hang") == 3 and kinds.count("kill") == 15
    assert all(0 <= f.rank < 4 and 0 < f.t_s <= 310 for f in a.faults)


def test_jitter_zero_and_pinned_rank_give_exact_instants() -> None:
    t = compile_trace("kill every=20s jitter=0 rank=2 start=5s", seed=0, ranks=4, horizon_s=50)
    assert [(f.t_s, f.rank) for f in t.faults] == [(5.0, 2), (25.0, 2), (45.0, 2)]
    assert t.within(30.0) == t.faults[:2]


def test_chaos_spec_is_accepted_by_stalwarts_chaos() -> None:
    t = compile_trace("kill every=20s; hang every=45s", seed=1, ranks=4, horizon_s=120)
    spec = t.chaos_spec()
    plan = parse_spec(spec)
    assert len(plan) == len(t.faults)
    assert "at=time:" in spec and spec.count(";") == len(t.faults) - 1
    assert compile_trace("kill every=1h", seed=0, ranks=1, horizon_s=10).chaos_spec() == ""


def test_recorded_trace_replays_as_is(tmp_path: Path) -> None:
    t = compile_trace("kill every=7s", seed=9, ranks=3, horizon_s=60)
    t.to_file(tmp_path / "trace.json")
    assert load_trace(tmp_path / "trace.json") == t


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("boom every=20s", "fault kind"),
        ("kill", "every=DURATION"),
        ("kill every=soon", "positive duration"),
        ("kill every=20s jitter=0.9", r"jitter takes a number in \[0, 0.5\]"),
        ("kill every=20s rank=4", r"rank takes 0..3"),
        ("kill every=20s every=3s", "once each"),
        ("kill every=20s colour=red", "keys every"),
    ],
)
def test_bad_specs_name_the_token_and_the_fix(spec: str, match: str) -> None:
    with pytest.raises(TraceSpecError, match=match):
        compile_trace(spec, seed=0, ranks=4, horizon_s=100)


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"version": 2}, "not a version 1 trace file"),
        ({"ranks": 0}, "outside"),
        ({"horizon_s": "long"}, "must be a float"),
        ({"faults": [{"t_s": 5.0, "kind": "kill", "rank": 7}]}, "'rank'=7 is outside"),
        ({"faults": [{"t_s": 500.0, "kind": "kill", "rank": 0}]}, "'t_s'=500.0 is outside"),
        ({"faults": [{"t_s": 5.0, "kind": "nap", "rank": 0}]}, "kind must be one of"),
    ],
)
def test_trace_files_are_checked_against_bounds(tmp_path: Path, patch: dict, match: str) -> None:
    doc = compile_trace("kill every=20s", seed=0, ranks=2, horizon_s=100).to_dict() | patch
    (tmp_path / "t.json").write_text(json.dumps(doc))
    with pytest.raises(TraceSpecError, match=match):
        load_trace(tmp_path / "t.json")
