"""The arrival relay's wire format: a node's workers arrive at an agreement through their
agent (docs/worker-contract.md, "The arrival relay").

Why: every worker of a generation publishes what it holds (its *arrival*,
runtime/rejoin/_rendezvous.py ``agree``) and waits for rank 0's agreement. A node of 8
workers made 8 transactions and opened 8 watches on the coordinator for one failure, so
a job of 1,024 nodes of 8 cost the store as much as 8,192 nodes of one (5-7x the
agreement time of a one-worker node, docs/scale.md). Through the relay, the agent writes
its workers' arrivals in one transaction (each guard is the same: the node's fence, the
generation, the agreement not yet published) and follows the agreement with one watch
for all of them.

One JSON object per line, both ways, at most :data:`MAX_LINE` bytes, each field checked
before use; a line that does not parse is refused, never raised (the worker then talks
to the store itself, as without a relay). Requests (``v`` 1)::

    {"v": 1, "op": "arrive", "key": K, "value": V, "guard": [[key, target, op, operand]..],
     "peers": W}
    {"v": 1, "op": "await", "prefix": P, "key": K, "end": E, "start": S}

and their replies: ``{"v": 1, "ok": bool, "rev": R}`` (the transaction's outcome and
revision); ``{"v": 1, "record": V}`` (the awaited key's value), ``{"v": 1, "end": true}``
(the generation's end marker came first) or ``{"v": 1, "broken": true}`` (the agent's
watch broke: the worker reads the store itself). ``peers`` (1 to 4,096) is how many
workers the node runs: the agent writes once that many arrivals are in (or after a
short linger, for one slow or gone). ``value`` operands are ASCII strings
(the generation's digits), the others integers. Keys must lie under the job's root:
arrivals under ``rt/``, agreements under ``agreed/`` (the agent writes nothing else for
a worker).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stalwart.coordinator.store import Compare, Put

__all__ = [
    "ARRIVALS_VERSION",
    "MAX_LINE",
    "Arrive",
    "Await",
    "Outcome",
    "encode",
    "encode_arrive",
    "encode_await",
    "parse_reply",
    "parse_request",
]

ARRIVALS_VERSION = 1
MAX_LINE = 1 << 20  # an arrival's info: a few hundred bytes; a rank's disk steps at most
_MAX_KEY = 512
_MAX_GUARD = 8
_MAX_OPERAND = 64
_TARGETS = ("mod_revision", "create_revision", "version", "value")
_OPS = ("==", "!=", "<", ">")
_MAX_INT = 1 << 62
_MAX_PEERS = 4096


@dataclass(frozen=True)
class Arrive:
    """Write ``put`` if every compare of ``guard`` holds; ``peers``: the workers of the
    node, whose arrivals the agent writes together."""

    guard: tuple[Compare, ...]
    put: Put
    peers: int = 1


@dataclass(frozen=True)
class Await:
    """The value of ``key`` once it is put under ``prefix``, watched from revision
    ``start``; ``end``: the key whose put says it never will be (the generation moved)."""

    prefix: str
    key: str
    end: str
    start: int


@dataclass(frozen=True)
class Outcome:
    """A reply: to an arrival (``ok``, ``rev``), or to a wait (``record``, ``end``,
    ``broken``)."""

    ok: bool = False
    rev: int = 0
    record: bytes | None = None
    end: bool = False
    broken: bool = False


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps({"v": ARRIVALS_VERSION, **doc}, separators=(",", ":")).encode() + b"\n"


def encode_arrive(req: Arrive) -> bytes | None:
    """The request line, or None where a compare's operand cannot travel (not ASCII)."""
    guard: list[list[Any]] = []
    for c in req.guard:
        operand: Any = c.operand
        if isinstance(operand, bytes):
            if not operand.isascii() or len(operand) > _MAX_OPERAND:
                return None
            operand = operand.decode()
        guard.append([c.key, c.target, c.op, operand])
    value = req.put.value.decode("utf-8", "strict") if req.put.value.isascii() else None
    if value is None or req.put.lease:
        return None
    doc = {"op": "arrive", "key": req.put.key, "value": value, "guard": guard}
    return encode({**doc, "peers": req.peers})


def encode_await(req: Await) -> bytes:
    return encode(
        {"op": "await", "prefix": req.prefix, "key": req.key, "end": req.end, "start": req.start}
    )


class _Bad(ValueError):
    pass


def _key(doc: dict[str, Any], name: str, root: str) -> str:
    key = doc.get(name)
    if not isinstance(key, str) or not key.startswith(root) or len(key) > _MAX_KEY:
        raise _Bad(f"{name}: a key under {root}")
    return key


def _int(value: Any, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= _MAX_INT:
        raise _Bad("an integer in bounds")
    return value


def _compare(item: Any, job_root: str) -> Compare:
    if not isinstance(item, list) or len(item) != 4:
        raise _Bad("a compare: [key, target, op, operand]")
    key, target, op, operand = item
    if not isinstance(key, str) or not key.startswith(job_root) or len(key) > _MAX_KEY:
        raise _Bad("a compare's key under the job's root")
    if target not in _TARGETS or op not in _OPS:
        raise _Bad("a compare's target and op")
    if target == "value":
        if not isinstance(operand, str) or not operand.isascii() or len(operand) > _MAX_OPERAND:
            raise _Bad("a value compare's operand: ASCII")
        return Compare(key, target, op, operand.encode())
    return Compare(key, target, op, _int(operand))


def parse_request(line: bytes, job_root: str) -> Arrive | Await | None:
    """A worker's request for the job under ``job_root`` (``/stalwart/<job>/``); None:
    malformed or out of bounds (the relay answers nothing to it and drops the worker)."""
    try:
        if len(line) > MAX_LINE:
            raise _Bad("too long")
        doc = json.loads(line)
        if not isinstance(doc, dict) or doc.get("v") != ARRIVALS_VERSION:
            raise _Bad("version")
        if doc.get("op") == "arrive":
            value = doc.get("value")
            guard = doc.get("guard")
            if not isinstance(value, str) or not isinstance(guard, list):
                raise _Bad("arrive: value and guard")
            if len(guard) > _MAX_GUARD:
                raise _Bad("arrive: too many compares")
            compares = tuple(_compare(c, job_root) for c in guard)
            put = Put(_key(doc, "key", job_root + "rt/"), value.encode())
            peers = _int(doc.get("peers"), 1)
            if peers > _MAX_PEERS:
                raise _Bad("arrive: peers")
            return Arrive(compares, put, peers)
        if doc.get("op") == "await":
            prefix = _key(doc, "prefix", job_root + "agreed/")
            key, end = _key(doc, "key", prefix), _key(doc, "end", job_root + "agreed/")
            return Await(prefix, key, end, _int(doc.get("start"), 1))
        raise _Bad("op")
    except (ValueError, TypeError, RecursionError):  # _Bad is a ValueError
        return None


def parse_reply(line: bytes) -> Outcome | None:
    """The agent's reply; None: malformed (the worker then asks the store itself)."""
    try:
        doc = json.loads(line)
        if not isinstance(doc, dict) or doc.get("v") != ARRIVALS_VERSION:
            return None
        if "ok" in doc:
            if not isinstance(doc["ok"], bool):
                return None
            return Outcome(ok=doc["ok"], rev=_int(doc.get("rev")))
        if "record" in doc:
            record = doc["record"]
            return Outcome(record=record.encode()) if isinstance(record, str) else None
        if doc.get("end") is True:
            return Outcome(end=True)
        if doc.get("broken") is True:
            return Outcome(broken=True)
        return None
    except (ValueError, TypeError, RecursionError):
        return None
