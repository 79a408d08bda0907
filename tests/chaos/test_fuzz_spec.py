"""Fuzzing the chaos spec parser: nothing but ChaosSpecError escapes, and whatever parses
is inside the documented bounds."""

from __future__ import annotations

import math

from hypothesis import event, given, settings
from hypothesis import strategies as st

from stalwart.chaos import ChaosSpecError, FaultPlan
from stalwart.chaos.spec import MAX_DURATION_S

_NUMBERS = st.one_of(
    st.integers(0, 20).map(str),
    st.integers(0, 20).map(str),
    st.integers(-5, 10**14).map(str),
    st.sampled_from(["²", "٣", "1e3", "inf", "nan", "-0", "0x10", "1_0", " 1", "1.", ".5", ""]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet="0123456789.²٣", max_size=30),
)
_UNITS = st.sampled_from(["", "s", "ms", "m", "h", "d", "S", "µs"])
_VALUES = st.one_of(
    _NUMBERS,
    st.builds(lambda n, u: f"step:{n}{u}", _NUMBERS, _UNITS),
    st.builds(lambda n, u: f"time:{n}{u}", _NUMBERS, _UNITS),
    st.text(max_size=12),
)
_KEYS = st.sampled_from(["rank", "node", "at", "for", "factor", "steps", "x", ""])
_TOKENS = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", _KEYS, _VALUES),
    st.sampled_from(["permanent", "=", "rank", "at=", "=1"]),
    st.text(max_size=8),
)
_FAULTS = st.builds(
    lambda kind, toks: " ".join([kind, *toks]),
    st.sampled_from(["kill", "hang", "slow", "join", "kil", ""]),
    st.lists(_TOKENS, max_size=6),
)
# near-valid faults: the grammar's shape with numbers inside and outside the bounds
_NEAR = st.builds(
    lambda kind, target, at, extra: " ".join([kind, target, at, *extra]),
    st.sampled_from(["kill", "hang", "slow", "join"]),
    st.builds(lambda k, n: f"{k}={n}", st.sampled_from(["rank", "node"]), _NUMBERS),
    st.one_of(
        st.integers(-1, 10**13).map(lambda n: f"at=step:{n}"),
        st.builds(lambda n, u: f"at=time:{n}{u}", _NUMBERS, _UNITS),
    ),
    st.lists(
        st.one_of(
            st.builds(lambda n: f"factor={n}", _NUMBERS),
            st.builds(lambda n, u: f"for={n}{u}", _NUMBERS, _UNITS),
            st.integers(-1, 2 * 10**9).map(lambda n: f"steps={n}"),
            st.just("permanent"),
        ),
        max_size=2,
    ),
)
# faults that parse unless a number crosses a bound: the bounds' edges are exercised
_EDGES = st.builds(
    lambda target, n, at: f"kill {target}={n} {at}",
    st.sampled_from(["rank", "node"]),
    st.integers(0, 10**6 + 1),
    st.one_of(
        st.integers(0, 10**12 + 1).map(lambda n: f"at=step:{n}"),
        st.floats(0, 3 * 10**6, allow_nan=False).map(lambda s: f"at=time:{s:.3f}s"),
    ),
)
_SPECS = st.one_of(
    st.lists(st.one_of(_EDGES, _NEAR, _FAULTS), max_size=4).map("; ".join),
    st.text(max_size=80),
)


@settings(max_examples=400, deadline=None, database=None)
@given(_SPECS)
def test_only_chaos_spec_errors_escape_and_parsed_faults_are_in_bounds(spec: str) -> None:
    try:
        plan = FaultPlan.parse(spec)
    except ChaosSpecError as err:
        assert "\n" not in str(err)
        return
    assert plan.faults or not spec  # an empty --chaos is no plan
    for f in plan.faults:
        assert (f.rank is None) != (f.node is None)
        assert all(0 <= x < 10**6 for x in (f.rank, f.node) if x is not None)
        assert (f.at_step is None) != (f.at_time is None)
        assert f.at_step is None or 1 <= f.at_step <= 10**12
        assert f.at_time is None or 0 <= f.at_time <= MAX_DURATION_S
        assert f.duration is None or 0 < f.duration <= MAX_DURATION_S
        assert math.isfinite(f.factor) and (f.kind != "slow" or 1 < f.factor <= 1000)
        assert f.steps is None or 1 <= f.steps <= 10**9
    assert FaultPlan.from_json(plan.to_json()) == plan
    event("parsed")  # (hypothesis --hypothesis-show-statistics: how many did)
