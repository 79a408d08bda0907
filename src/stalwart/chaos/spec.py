"""The chaos spec language: ``FAULT key=value ...`` separated by ``;``.

Faults: ``kill`` (SIGKILL), ``hang`` (SIGSTOP: the process is alive but makes no
progress, which only a watchdog notices), ``slow`` (``factor=F``: steps take F times as
long, for ``for=DURATION`` or ``steps=N``). Target: ``rank=R`` or ``node=N`` (a node
fault takes the whole node: its agent and workers). Trigger: ``at=step:N`` (when the
target begins step N) or ``at=time:DURATION`` (seconds after the run started; ``40s``,
``1.5m``, ``250ms``).

Elastic runs (``--strategy elastic``) add ``permanent`` to ``kill`` (``kill rank=3
at=step:15 permanent``: the member is not started again, the job goes on smaller) and
the fault ``join`` (``join node=1 at=step:40``, ``join rank=3 at=time:30s``): the member
(or every member of the node) is started again and admitted at the next step boundary.
``rank`` names a member by the rank it was launched with (ranks are renumbered densely
after a resize).

Errors are one line that quotes the bad token and says what would be accepted, because
a spec is typed on a command line and the fix is a one-word edit.
"""

from __future__ import annotations

import re

from stalwart.errors import ConfigError

__all__ = ["FAULT_KINDS", "ChaosSpecError", "parse_duration", "parse_spec"]

FAULT_KINDS = ("kill", "hang", "slow", "join")
_KEYS = {
    "kill": {"rank", "node", "at"},
    "hang": {"rank", "node", "at", "for"},
    "slow": {"rank", "node", "at", "factor", "for", "steps"},
    "join": {"rank", "node", "at"},
}
_FLAGS = {"kill": {"permanent"}}  # bare words
_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)?$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class ChaosSpecError(ConfigError):
    """A chaos spec does not parse; the message quotes the bad token."""


def parse_duration(text: str) -> float | None:
    """``40s`` -> 40.0; ``None`` if ``text`` is not a duration."""
    m = _DURATION.match(text)
    if m is None:
        return None
    return float(m.group(1)) * _UNIT[m.group(2)]


def _bad(spec: str, token: str, why: str) -> ChaosSpecError:
    return ChaosSpecError(f"chaos spec {spec!r}: bad token {token!r}: {why}")


def _int(spec: str, token: str, value: str, what: str) -> int:
    if not value.isdigit():
        raise _bad(spec, token, f"{what} takes a non-negative integer, e.g. {what}=1")
    return int(value)


def parse_spec(spec: str) -> list[dict[str, object]]:
    """Parse ``spec`` into fault records (dicts ready for :class:`Fault`); raises
    :class:`ChaosSpecError` naming the bad token."""
    faults: list[dict[str, object]] = []
    for index, part in enumerate(p.strip() for p in spec.split(";")):
        if not part:
            continue
        tokens = part.split()
        kind = tokens[0]
        if kind not in _KEYS:
            raise _bad(spec, kind, f"unknown fault; use one of {', '.join(FAULT_KINDS)}")
        rec: dict[str, object] = {"id": index, "kind": kind, "text": part}
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
            if key in rec:
                raise _bad(spec, token, f"{key}= given twice in one fault")
            if key in ("rank", "node", "steps"):
                rec[key] = _int(spec, token, value, key)
            elif key == "at":
                what, _, arg = value.partition(":")
                if what == "step" and arg.isdigit():
                    rec["at_step"] = int(arg)
                elif what == "time" and parse_duration(arg) is not None:
                    rec["at_time"] = parse_duration(arg)
                else:
                    raise _bad(spec, token, "at= takes step:N or time:DURATION (e.g. time:40s)")
                rec[key] = value
            elif key == "for":
                seconds = parse_duration(value)
                if seconds is None or seconds <= 0:
                    raise _bad(spec, token, "for= takes a positive duration, e.g. for=30s")
                rec["duration"] = seconds
                rec[key] = value
            elif key == "factor":
                try:
                    factor = float(value)
                except ValueError:
                    factor = 0.0
                if not factor > 1.0:
                    raise _bad(spec, token, "factor= takes a number > 1, e.g. factor=3")
                rec["factor"] = factor
        if ("rank" in rec) == ("node" in rec):
            raise _bad(spec, part, "name exactly one target: rank=R or node=N")
        if "at" not in rec:
            raise _bad(spec, part, "say when: at=step:N or at=time:DURATION")
        if kind == "slow" and "factor" not in rec:
            raise _bad(spec, part, "slow needs factor=F (F > 1)")
        for key in ("at", "for"):
            rec.pop(key, None)
        faults.append(rec)
    if not faults:
        raise ChaosSpecError(f"chaos spec {spec!r} names no fault; e.g. 'kill rank=1 at=step:50'")
    return faults
