"""The chaos spec language: ``FAULT key=value ...`` separated by ``;``.

Faults: ``kill`` (SIGKILL), ``hang`` (SIGSTOP: the process is alive but makes no
progress, which only a watchdog notices), ``slow`` (``factor=F``: steps take F times as
long, for ``for=DURATION`` or ``steps=N``). Target: ``rank=R`` or ``node=N`` (a node
fault takes the whole node: its agent and workers). Trigger: ``at=step:N`` (when the
target begins step N; steps count from 1) or ``at=time:DURATION`` (``40s``, ``1.5m``,
``250ms``), measured from the job's first step: the moment the first worker of the node
that fires the fault reports a step, so the launcher's start-up (the torch import, the
script's set-up) is not counted, and a restart does not move the origin. A fault queued
by ``stalwart chaos`` against a live run counts from the moment it was queued.

On a plain script (one that never calls ``stalwart.init()``), step N is the script's Nth
``optimizer.step()``: a step-keyed rank fault fires just before that call (the agent
watches optimizer steps; a script that steps no optimizer fires no step-keyed fault, and
the run's end says so).

Bounds: ``rank``/``node`` below 1,000,000 and inside the job (checked at start: a target
outside the job is refused); a step in 1..10^12; ``steps=`` in 1..10^9; durations up to
30 days; ``factor`` in (1, 1000]. Numbers are ASCII digits.

Elastic runs (``--strategy elastic``) add ``permanent`` to ``kill`` (``kill rank=3
at=step:15 permanent``: the member is not started again, the job goes on smaller) and
the fault ``join`` (``join node=1 at=step:40``, ``join rank=3 at=time:30s``): the member
(or every member of the node) is started again and admitted at the next step boundary.
``rank`` names a member by the rank it was launched with (ranks are renumbered densely
after a resize).

Numerical faults, for the integrity checks (runtime/integrity/_checks.py, docs/detection.md):
``corrupt rank=R at=step:S`` flips one bit of one element of one replicated tensor (a
parameter or an optimizer moment) of that rank, a silent data corruption its DDP peers
do not share; ``param=I`` (the tensor's index among them, wrapped), ``elem=E`` (wrapped)
and ``bit=B`` (0..63, wrapped to the element's width) pin it down, else each is drawn
from a generator seeded by the fault's id and step (the same flip in every run).
``nan rank=R at=step:S`` sets one element of the first parameter to NaN, so that the
step's loss and, after the allreduce, every replica's state are NaN; it models a bad
batch, so it fires every time step S is run (replays included), not once. Both fire when
the target begins step S (rank faults only, step-keyed only).

Errors are one line that quotes the bad token and says what would be accepted, because
a spec is typed on a command line and the fix is a one-word edit.
"""

from __future__ import annotations

import re

from stalwart.errors import ConfigError

__all__ = [
    "FAULT_KINDS",
    "MAX_DURATION_S",
    "MAX_FAULTS",
    "ChaosSpecError",
    "parse_duration",
    "parse_spec",
]

FAULT_KINDS = ("kill", "hang", "slow", "join", "corrupt", "nan")
_KEYS = {
    "kill": {"rank", "node", "at"},
    "hang": {"rank", "node", "at", "for"},
    "slow": {"rank", "node", "at", "factor", "for", "steps"},
    "join": {"rank", "node", "at"},
    "corrupt": {"rank", "at", "param", "elem", "bit"},
    "nan": {"rank", "at"},
}
_FLAGS = {"kill": {"permanent"}}  # bare words
_NUMBER = r"(?:[0-9]{1,12}(?:\.[0-9]{0,9})?|\.[0-9]{1,9})"
_DURATION = re.compile(rf"({_NUMBER})(ms|s|m|h)?", re.ASCII)
_FACTOR = re.compile(_NUMBER, re.ASCII)
_DIGITS = re.compile(r"[0-9]{1,13}", re.ASCII)
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
MAX_DURATION_S = 30 * 86400.0
"""Longest duration a spec takes (30 days: longer than a two-week job)."""
MAX_FAULTS = 1000
_MAX = {
    "rank": 999_999,
    "node": 999_999,
    "steps": 10**9,
    "step": 10**12,
    "param": 10**9,
    "elem": 10**12,
    "bit": 63,
}
_STEP_ONLY = ("corrupt", "nan")  # fired inside the step loop, on a replica's tensors
_MAX_FACTOR = 1000.0  # slow's duty cycle runs 0.1 ms of every 100 ms at this factor


class ChaosSpecError(ConfigError):
    """A chaos spec does not parse; the message quotes the bad token."""


def parse_duration(text: str) -> float | None:
    """``40s`` -> 40.0; ``None`` if ``text`` is not a duration (ASCII digits, a unit of
    ms, s, m or h, at most :data:`MAX_DURATION_S`)."""
    m = _DURATION.fullmatch(text)
    if m is None:
        return None
    seconds = float(m.group(1)) * _UNIT[m.group(2)]
    return seconds if seconds <= MAX_DURATION_S else None


def _bad(spec: str, token: str, why: str) -> ChaosSpecError:
    shown = spec if len(spec) <= 200 else spec[:200] + "..."
    return ChaosSpecError(f"chaos spec {shown!r}: bad token {token!r}: {why}")


def _int(spec: str, token: str, value: str, what: str, low: int = 0) -> int:
    high = _MAX[what]
    number = int(value) if _DIGITS.fullmatch(value) else -1
    if not low <= number <= high:
        raise _bad(spec, token, f"{what} takes an integer in {low}..{high}, e.g. {what}={low + 1}")
    return number


def _factor(spec: str, token: str, value: str) -> float:
    factor = float(value) if _FACTOR.fullmatch(value) else 0.0
    if not 1.0 < factor <= _MAX_FACTOR:
        raise _bad(spec, token, f"factor= takes a number > 1 and <= {_MAX_FACTOR:g}, e.g. factor=3")
    return factor


def _at(spec: str, token: str, value: str, rec: dict[str, object]) -> None:
    what, _, arg = value.partition(":")
    if what == "step":
        rec["at_step"] = _int(spec, token, arg, "step", low=1)
        return
    seconds = parse_duration(arg) if what == "time" else None
    if seconds is None:
        raise _bad(
            spec,
            token,
            "at= takes step:N (N >= 1) or time:DURATION up to 30 days (e.g. time:40s)",
        )
    rec["at_time"] = seconds


def parse_spec(spec: str) -> list[dict[str, object]]:
    """Parse ``spec`` into fault records (dicts ready for :class:`Fault`); raises
    :class:`ChaosSpecError` naming the bad token."""
    faults: list[dict[str, object]] = []
    for index, part in enumerate(p.strip() for p in spec.split(";")):
        if not part:
            continue
        if len(faults) >= MAX_FAULTS:
            raise ChaosSpecError(f"chaos spec names more than {MAX_FAULTS} faults; split it up")
        faults.append(_parse_fault(spec, index, part))
    if not faults:
        raise ChaosSpecError(
            f"chaos spec {spec[:200]!r} names no fault; e.g. 'kill rank=1 at=step:50'"
        )
    return faults


def _parse_fault(spec: str, index: int, part: str) -> dict[str, object]:
    tokens = part.split()
    kind = tokens[0]
    if kind not in _KEYS:
        raise _bad(spec, kind, f"unknown fault; use one of {', '.join(FAULT_KINDS)}")
    rec: dict[str, object] = {"id": index, "kind": kind, "text": part}
    seen: set[str] = set()
    for token in tokens[1:]:
        if token in _FLAGS.get(kind, ()):
            if token in rec:
                raise _bad(spec, token, f"{token} given twice in one fault")
            rec[token] = True
            continue
        key, sep, value = token.partition("=")
        if not sep or not value:
            raise _bad(spec, token, "expected key=value, e.g. rank=1")
        if key not in _KEYS[kind]:
            allowed = ", ".join(sorted(_KEYS[kind] | _FLAGS.get(kind, set())))
            raise _bad(spec, token, f"{kind} takes {allowed}")
        if key in seen:
            raise _bad(spec, token, f"{key}= given twice in one fault")
        seen.add(key)
        if key in ("rank", "node", "param", "elem", "bit"):
            rec[key] = _int(spec, token, value, key)
        elif key == "steps":
            rec[key] = _int(spec, token, value, key, low=1)
        elif key == "at":
            _at(spec, token, value, rec)
        elif key == "for":
            seconds = parse_duration(value)
            if seconds is None or seconds <= 0:
                raise _bad(
                    spec, token, "for= takes a positive duration up to 30 days, e.g. for=30s"
                )
            rec["duration"] = seconds
        else:  # factor
            rec["factor"] = _factor(spec, token, value)
    if ("rank" in rec) == ("node" in rec):
        raise _bad(spec, part, "name exactly one target: rank=R or node=N")
    if "at" not in seen:
        raise _bad(spec, part, "say when: at=step:N or at=time:DURATION")
    if kind in _STEP_ONLY and "at_step" not in rec:
        raise _bad(spec, part, f"{kind} fires inside the step loop: give at=step:N")
    if kind == "slow" and "factor" not in rec:
        raise _bad(spec, part, "slow needs factor=F (F > 1)")
    return rec
