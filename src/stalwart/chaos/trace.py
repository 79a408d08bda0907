"""Fault traces: one recorded list of fault instants, replayed identically on every route.

``stalwart compare`` runs the same job under several recovery routes and must strike each
with the *same* faults, or the comparison measures the dice. A trace spec such as
``"kill every=20s; hang every=90s"`` is therefore compiled once, with a seed, into a list of
instants (seconds after the job's first step), a kind and a target rank, and that list is
what every route replays (``FaultTrace.to_file`` / ``load_trace``: a recorded trace file is
replayed as is). Under stalwart the instants become ``at=time:`` chaos faults (the agent
measures them from the first step, docs/chaos of :mod:`stalwart.chaos.spec`); under
torchrun, which has no chaos, ``stalwart compare`` sends the same signals itself.

Spec grammar (``;`` between clauses): ``KIND every=DURATION [rank=R] [jitter=F]
[start=DURATION]``; ``KIND`` is ``kill`` (SIGKILL) or ``hang`` (SIGSTOP). The n-th fault of
a clause strikes at ``start + n * every`` (``start`` defaults to ``every``) moved by a
seeded uniform draw of up to ``jitter * every`` either way (``jitter`` in [0, 0.5], default
0.2: periodic faults in lockstep with a checkpoint cadence would flatter or punish one
route by accident), on ``rank`` or on a seeded draw among the job's ranks. Instants are
generated up to ``horizon_s``, the longest a route may run.

File format (JSON, ``version`` 1): ``{"version": 1, "spec": str, "seed": int, "ranks":
int, "horizon_s": float, "faults": [{"t_s": float, "kind": "kill"|"hang", "rank": int}]}``,
faults sorted by ``t_s``; every field is checked against its bounds on load
(docs/routes.md).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.chaos.spec import MAX_DURATION_S, MAX_FAULTS, parse_duration
from stalwart.errors import ConfigError
from stalwart.userfile import open_regular

__all__ = [
    "TRACE_KINDS",
    "TRACE_VERSION",
    "FaultTrace",
    "TraceFault",
    "TraceSpecError",
    "compile_trace",
    "load_trace",
]

TRACE_VERSION = 1
TRACE_KINDS = ("kill", "hang")
_MAX_RANKS = 1_000_000
_CLAUSE_KEYS = {"every", "rank", "jitter", "start"}


class TraceSpecError(ConfigError):
    """A trace spec or trace file is malformed (the message quotes it and says the fix)."""


@dataclass(frozen=True)
class TraceFault:
    """One fault of a trace: ``t_s`` seconds after the job's first step, on ``rank``."""

    t_s: float
    kind: str
    rank: int

    def chaos(self) -> str:
        """This fault as a stalwart chaos clause (``kill rank=2 at=time:20.000s``)."""
        return f"{self.kind} rank={self.rank} at=time:{self.t_s:.3f}s"


@dataclass(frozen=True)
class FaultTrace:
    """A compiled trace: what every route of one comparison replays."""

    spec: str
    seed: int
    ranks: int
    horizon_s: float
    faults: tuple[TraceFault, ...]

    def chaos_spec(self) -> str:
        """The whole trace as one ``--chaos`` spec ("" when it has no fault)."""
        return "; ".join(f.chaos() for f in self.faults)

    def within(self, seconds: float) -> tuple[TraceFault, ...]:
        """The faults that strike in the first ``seconds`` after the first step."""
        return tuple(f for f in self.faults if f.t_s <= seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": TRACE_VERSION,
            "spec": self.spec,
            "seed": self.seed,
            "ranks": self.ranks,
            "horizon_s": self.horizon_s,
            "faults": [{"t_s": f.t_s, "kind": f.kind, "rank": f.rank} for f in self.faults],
        }

    def to_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _bad(spec: str, token: str, why: str) -> TraceSpecError:
    return TraceSpecError(f"trace spec {spec!r}: bad token {token!r}: {why}")


def _seconds(spec: str, token: str, value: str) -> float:
    seconds = parse_duration(value)
    if seconds is None or seconds <= 0:
        raise _bad(spec, token, "takes a positive duration such as 20s, 1.5m or 500ms")
    return seconds


def _clause(spec: str, text: str) -> tuple[str, dict[str, str]]:
    words = text.split()
    kind = words[0]
    if kind not in TRACE_KINDS:
        raise _bad(spec, kind, f"a clause starts with a fault kind: {' or '.join(TRACE_KINDS)}")
    keys: dict[str, str] = {}
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if not eq or key not in _CLAUSE_KEYS or key in keys:
            keys_list = ", ".join(sorted(_CLAUSE_KEYS))
            raise _bad(spec, word, f"use key=value once each, keys {keys_list}")
        keys[key] = value
    if "every" not in keys:
        raise _bad(spec, text, "each clause needs every=DURATION, e.g. 'kill every=20s'")
    return kind, keys


def _instants(spec: str, keys: dict[str, str], horizon_s: float, rng: random.Random) -> list[float]:
    every = _seconds(spec, "every=" + keys["every"], keys["every"])
    start = _seconds(spec, "start=" + keys["start"], keys["start"]) if "start" in keys else every
    try:
        jitter = float(keys.get("jitter", "0.2"))
    except ValueError:
        jitter = -1.0
    if not 0.0 <= jitter <= 0.5:
        raise _bad(spec, "jitter=" + keys.get("jitter", ""), "jitter takes a number in [0, 0.5]")
    out: list[float] = []
    n = 0
    while start + n * every <= horizon_s and len(out) < MAX_FAULTS:
        t = round(max(start + n * every + rng.uniform(-jitter, jitter) * every, 0.001), 3)
        if t <= horizon_s:
            out.append(t)
        n += 1
    return out


def compile_trace(spec: str, *, seed: int, ranks: int, horizon_s: float) -> FaultTrace:
    """Compile ``spec`` into the instants every route replays (same seed: same trace)."""
    if not 1 <= ranks <= _MAX_RANKS:
        raise TraceSpecError(f"a trace needs 1..{_MAX_RANKS} ranks, not {ranks}")
    if not 0 < horizon_s <= MAX_DURATION_S:
        raise TraceSpecError(f"trace horizon {horizon_s} s: give one in (0, {MAX_DURATION_S}]")
    rng = random.Random(seed)
    faults: list[TraceFault] = []
    for text in (c.strip() for c in spec.split(";")):
        if not text:
            continue
        kind, keys = _clause(spec, text)
        for t in _instants(spec, keys, horizon_s, rng):
            if "rank" in keys:
                rank = int(keys["rank"]) if keys["rank"].isdigit() else -1
                if not 0 <= rank < ranks:
                    raise _bad(spec, "rank=" + keys["rank"], f"rank takes 0..{ranks - 1}")
            else:
                rank = rng.randrange(ranks)
            faults.append(TraceFault(t, kind, rank))
    if len(faults) > MAX_FAULTS:
        raise TraceSpecError(f"trace spec {spec!r}: over {MAX_FAULTS} faults; raise every=")
    faults.sort(key=lambda f: f.t_s)
    return FaultTrace(spec, seed, ranks, horizon_s, tuple(faults))


def _field(where: str, raw: dict[str, Any], key: str, kind: type, low: float, high: float) -> float:
    value = raw.get(key)
    types = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) or not isinstance(value, types):
        raise TraceSpecError(f"{where}: {key!r} must be a {kind.__name__}; re-record the trace")
    assert isinstance(value, (int, float))
    if not low <= value <= high:
        raise TraceSpecError(f"{where}: {key!r}={value} is outside [{low}, {high}]")
    return value


def load_trace(path: str | Path) -> FaultTrace:
    """Read a recorded trace file (every field validated; TraceSpecError names the fix)."""
    where = str(path)
    try:
        fix = "pass a trace file that `stalwart compare` recorded (OUT/trace.json)"
        with open_regular(path, what="the trace file", fix=fix) as f:
            raw = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise TraceSpecError(f"cannot read trace file {where}: {err}") from err
    if not isinstance(raw, dict) or raw.get("version") != TRACE_VERSION:
        raise TraceSpecError(f"{where}: not a version {TRACE_VERSION} trace file")
    ranks = int(_field(where, raw, "ranks", int, 1, _MAX_RANKS))
    horizon = float(_field(where, raw, "horizon_s", float, 1e-3, MAX_DURATION_S))
    seed = int(_field(where, raw, "seed", int, -(2**63), 2**63 - 1))
    spec = raw.get("spec")
    items = raw.get("faults")
    if not isinstance(spec, str) or not isinstance(items, list) or len(items) > MAX_FAULTS:
        raise TraceSpecError(f"{where}: needs a 'spec' string and at most {MAX_FAULTS} 'faults'")
    faults = []
    for i, item in enumerate(items):
        at = f"{where} fault {i}"
        if not isinstance(item, dict) or item.get("kind") not in TRACE_KINDS:
            raise TraceSpecError(f"{at}: kind must be one of {', '.join(TRACE_KINDS)}")
        t = float(_field(at, item, "t_s", float, 1e-3, horizon))
        rank = int(_field(at, item, "rank", int, 0, ranks - 1))
        faults.append(TraceFault(t, str(item["kind"]), rank))
    faults.sort(key=lambda f: f.t_s)
    return FaultTrace(spec, seed, ranks, horizon, tuple(faults))
