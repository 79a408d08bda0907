"""State handoff through the coordinator store: a joiner asks, a survivor sends.

Why through the store: the joiner does not know which survivor will serve it, and the
survivors do not know the joiner's address; both already talk to the job's store
(authenticated, fenced by generation). The joiner starts a :class:`SlotReceiver` and
puts a *request* under a key of the caller's choosing (the runtime uses one per
generation and rank, e.g. ``stalwart/<job>/gen<g>/state-request/<rank>``); any survivor
that sees requests under the prefix sends its newest complete slot to each. The store
carries only the address and the namespace, never state.

The request is a small JSON object ``{"v": 1, "host", "port", "namespace"}``; a
malformed one is skipped with a logged reason (the store is authenticated, but a
request is still input).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from stalwart.coordinator.store import Store, wait_for
from stalwart.logs import get_logger
from stalwart.transfer.errors import SourceChangedError, TransferError
from stalwart.transfer.receiver import ReceiverConfig, ReceiveResult, SlotReceiver
from stalwart.transfer.sender import SendConfig, SendResult, send_slot

__all__ = ["StateRequest", "pending_requests", "request_state", "serve_requests"]

_log = get_logger(__name__)
_VERSION = 1


@dataclass(frozen=True)
class StateRequest:
    key: str
    host: str
    port: int
    namespace: str

    def encode(self) -> bytes:
        doc = {"v": _VERSION, "host": self.host, "port": self.port, "namespace": self.namespace}
        return json.dumps(doc).encode()

    @staticmethod
    def decode(key: str, value: bytes) -> StateRequest:
        try:
            d = json.loads(value)
            if not isinstance(d, dict) or d.get("v") != _VERSION:
                raise ValueError("not a version-1 request")
            host, port, ns = d["host"], d["port"], d["namespace"]
            if not isinstance(host, str) or not isinstance(ns, str):
                raise ValueError("host and namespace must be strings")
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise ValueError("port must be an integer in 1..65535")
            return StateRequest(key, host, port, ns)
        except (ValueError, KeyError, TypeError) as err:
            raise TransferError(f"state request {key!r} is malformed: {err}") from None


def request_state(
    store: Store,
    key: str,
    token: bytes,
    namespace: str,
    *,
    config: ReceiverConfig | None = None,
    timeout_s: float = 120.0,
) -> ReceiveResult:
    """Joiner side: publish a request at ``key`` and wait for a complete slot in
    ``namespace`` (failed attempts are waited out: a survivor retries). The request is
    deleted on return. TimeoutError names the key if nobody served it in time."""
    deadline = time.monotonic() + timeout_s
    with SlotReceiver(token, config) as rx:
        host, port = rx.address
        store.put(key, StateRequest(key, host, port, namespace).encode())
        try:
            seen = 0
            while True:
                left = deadline - time.monotonic()
                try:
                    results = rx.wait_results(seen + 1, max(left, 0.0))
                except TimeoutError:
                    raise TimeoutError(
                        f"no survivor sent the state requested at {key!r} within "
                        f"{timeout_s:.0f} s; is a survivor serving requests under its prefix?"
                    ) from None
                for r in results[seen:]:
                    if r.ok and r.namespace == namespace:
                        return r
                seen = len(results)
        finally:
            store.delete(key)


def pending_requests(store: Store, prefix: str) -> list[StateRequest]:
    """Well-formed requests under ``prefix`` (malformed ones are logged and skipped)."""
    out = []
    for kv in store.range(prefix).kvs:
        try:
            out.append(StateRequest.decode(kv.key, kv.value))
        except TransferError as err:
            _log.warning("%s", err)
    return out


def serve_requests(
    store: Store,
    prefix: str,
    token: bytes,
    source_dir: str,
    *,
    config: SendConfig | None = None,
    wait_s: float = 0.0,
    attempts: int = 3,
) -> list[SendResult]:
    """Survivor side: send the newest complete slot of ``source_dir`` to every request
    under ``prefix`` (waiting up to ``wait_s`` for the first one). A transfer overtaken
    by a newer snapshot is retried up to ``attempts`` times; other failures are logged
    and left for the joiner's timeout (another survivor may serve it)."""
    if wait_s > 0:
        wait_for(store, prefix, lambda r: bool(r.kvs), wait_s)
    sent = []
    for req in pending_requests(store, prefix):
        for attempt in range(1, attempts + 1):
            try:
                sent.append(
                    send_slot((req.host, req.port), token, source_dir, req.namespace, config=config)
                )
                break
            except SourceChangedError:
                if attempt == attempts:
                    _log.warning("state for %s: overtaken by snapshots %d times", req.key, attempts)
            except TransferError as err:
                _log.warning("state for %s not sent: %s", req.key, err)
                break
    return sent
