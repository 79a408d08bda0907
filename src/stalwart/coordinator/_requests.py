"""A store server request, from its checked body to its reply: the op table (_ops.py),
exactly-once retries of mutations (the request ids remembered) and the counters.

Everything here runs on the server's one event-loop thread (_loop.py), in order: no
lock, and a retried request finds its first attempt finished (nothing is in flight).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from stalwart.coordinator import wire
from stalwart.coordinator._ops import HANDLERS, OpContext
from stalwart.coordinator.errors import ProtocolError, StoreClosedError

__all__: list[str] = []

# Ops a retried request must not apply twice (their request id remembered). Not a
# keepalive: renewing twice is renewing once, and at N nodes keepalives are most of the
# steady requests (no remembered reply, no event per renewal).
_MUTATING = frozenset({"put", "delete", "txn", "grant", "revoke"})


class Request:
    """A request body that checked out: its op, arguments and request id."""

    __slots__ = ("args", "op", "rid")

    def __init__(self, op: str, args: dict[str, Any], rid: str | None) -> None:
        self.op, self.args, self.rid = op, args, rid


class Requests:
    """Parse, run and remember requests; ``stats`` counts them."""

    def __init__(self, ctx: OpContext, dedup_entries: int, log: logging.Logger) -> None:
        self.ctx = ctx
        self._dedup_entries = dedup_entries
        self._dedup: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._log = log
        self.stats = {"requests": 0, "rejected": 0, "auth_failures": 0}

    def parse(self, body: bytes, peer: Any) -> Request | dict[str, Any]:
        """The request, or the ``bad_request`` reply it gets."""
        try:
            req = wire.decode(body)
            op = wire.field(req, "op", str)
            args = wire.field(req, "args", dict, {})
            rid = wire.field(req, "rid", str, None)
            if op not in HANDLERS:
                raise ProtocolError(f"unknown op {op!r}")
        except ProtocolError as exc:
            self.stats["rejected"] += 1
            self._log.warning("store: rejected request from %s: %s", peer, exc)
            return {"ok": False, "error": {"code": "bad_request", "message": str(exc)}}
        self.stats["requests"] += 1
        return Request(op, args, rid)

    def run(self, req: Request) -> dict[str, Any]:
        """The reply to a short request (a retried mutation gets its first reply)."""
        if req.rid is None or req.op not in _MUTATING:
            return self.execute(HANDLERS[req.op], self.ctx, req.args)
        reply = self._dedup.get(req.rid)
        if reply is None:
            reply = self._dedup[req.rid] = self.execute(HANDLERS[req.op], self.ctx, req.args)
            while len(self._dedup) > self._dedup_entries:
                self._dedup.popitem(last=False)
        return reply

    def execute(self, fn: Any, *args: Any) -> dict[str, Any]:
        """``{"ok": True, "result": fn(*args)}``, or the error reply its exception maps to."""
        try:
            return {"ok": True, "result": fn(*args)}
        except StoreClosedError as exc:
            return {"ok": False, "error": {"code": "shutting_down", "message": str(exc)}}
        except Exception as exc:
            code = wire.code_for(exc)
            if code == "internal":
                self._log.exception("store: internal error")
            return {"ok": False, "error": {"code": code, "message": str(exc) or type(exc).__name__}}
