"""Request handlers of :class:`StoreServer`: one function per wire op.

Kept apart from the connection handling so that the table of ops (which mirrors
docs/wire-protocol.md) reads in one place. Handlers validate every argument and
raise ProtocolError / FrameTooLargeError / ValueError for bad input, which the
server turns into error replies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.coordinator import wire
from stalwart.coordinator.errors import FrameTooLargeError
from stalwart.coordinator.memory import MAX_LEASE_TTL, MemoryStore
from stalwart.coordinator.store import Put

__all__: list[str] = []


@dataclass(frozen=True)
class OpContext:
    """What a handler may use: the store and the size limits."""

    store: MemoryStore
    max_frame_bytes: int
    max_key_bytes: int
    max_value_bytes: int
    max_watch_wait: float


def _key(ctx: OpContext, args: dict[str, Any], name: str = "key") -> str:
    key: str = wire.field(args, name, str)
    if len(key.encode()) > ctx.max_key_bytes:
        raise FrameTooLargeError(f"{name} is longer than {ctx.max_key_bytes} bytes")
    return key


def _value(ctx: OpContext, args: dict[str, Any]) -> bytes:
    value = wire.b64d(args.get("value"))
    if len(value) > ctx.max_value_bytes:
        raise FrameTooLargeError(f"value of {len(value)} bytes exceeds {ctx.max_value_bytes}")
    return value


def _op_put(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    lease = wire.field(a, "lease", int, None)
    return {"revision": ctx.store.put(_key(ctx, a), _value(ctx, a), lease)}


def _op_get(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    kv = ctx.store.get(_key(ctx, a))
    return {"kv": None if kv is None else wire.kv_to_json(kv)}


def _op_range(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    res = ctx.store.range(_key(ctx, a, "prefix") if a.get("prefix") else "")
    return {"kvs": [wire.kv_to_json(kv) for kv in res.kvs], "revision": res.revision}


def _op_delete(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    return {"deleted": ctx.store.delete(_key(ctx, a), prefix=wire.field(a, "prefix", bool, False))}


def _op_txn(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    lists = [wire.field(a, name, list, []) for name in ("compare", "success", "failure")]
    compare = [wire.compare_from_json(c) for c in lists[0]]
    success, failure = ([wire.op_from_json(o) for o in ops] for ops in lists[1:])
    for op in (*success, *failure):
        _key(ctx, {"key": op.key})
        if isinstance(op, Put) and len(op.value) > ctx.max_value_bytes:
            raise FrameTooLargeError(f"value exceeds {ctx.max_value_bytes} bytes")
    res = ctx.store.txn(compare, success, failure)
    return {"succeeded": res.succeeded, "revision": res.revision}


def _op_grant(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    return {"lease": ctx.store.grant(wire.number(a, "ttl", 0.0, MAX_LEASE_TTL))}


def _op_keepalive(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    return {"ttl": ctx.store.keepalive(wire.field(a, "lease", int))}


def _op_time_to_live(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    return {"ttl": ctx.store.time_to_live(wire.field(a, "lease", int))}


def _op_revoke(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    return {"revoked": ctx.store.revoke(wire.field(a, "lease", int))}


def watch_args(ctx: OpContext, a: dict[str, Any]) -> tuple[str, int, float]:
    """A watch's ``(prefix, start_revision, seconds to wait)``, each field checked."""
    prefix = _key(ctx, a, "prefix") if a.get("prefix") else ""
    start = wire.field(a, "start_revision", int)
    return prefix, start, min(wire.number(a, "timeout", 0.0, math.inf, 0.0), ctx.max_watch_wait)


def watch_poll(ctx: OpContext, prefix: str, start: int) -> dict[str, Any]:
    """The events under ``prefix`` from ``start`` now (maybe none): never blocks. With
    none, ``revision`` says how far the store looked (docs/wire-protocol.md)."""
    events, looked_to = ctx.store.poll_events(prefix, start, max_bytes=ctx.max_frame_bytes // 4)
    if not events:
        return {"events": [], "revision": looked_to}
    return {"events": [wire.event_to_json(e) for e in events]}


def _op_watch(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    """A long-poll: the server's event loop parks it until a write under its prefix, its
    timeout or the server's stop (_loop.py); this is its first look."""
    prefix, start, _ = watch_args(ctx, a)
    return watch_poll(ctx, prefix, start)


def _op_ping(ctx: OpContext, a: dict[str, Any]) -> dict[str, Any]:
    return {"revision": ctx.store.revision, "versions": list(wire.SUPPORTED_VERSIONS)}


Handler = Callable[[OpContext, dict[str, Any]], dict[str, Any]]
HANDLERS: dict[str, Handler] = {
    name.removeprefix("_op_"): fn for name, fn in list(globals().items()) if name.startswith("_op_")
}
