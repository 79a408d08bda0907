"""A ``torch.distributed.Store`` over the coordinator's :class:`Store` (etcd, embedded).

Why: with ``--rdzv etcd://...`` nothing may depend on node 0, and the c10d TCPStore
that gloo's group formation uses is hosted by node 0's zygote. Rather than a second
server (a per-generation TCPStore hosted by some leader, published in etcd, re-hosted
when that leader dies), the gloo rendezvous keys go to the store the job already
trusts: its writes are compare-and-swap transactions that survive any one machine,
and group formation is a few dozen small keys per generation (torch's own
``torch/distributed/elastic/rendezvous/etcd_store.py`` is the same idea). Used under
a ``PrefixStore`` per generation, exactly as the TCPStore is.

Blocking reads poll with a short backoff (1 ms doubling to 20 ms): a formation reads
each peer's address once, so a watch stream per key would cost more than it saves.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from stalwart.coordinator.store import Compare, Put, Store

__all__ = ["CoordStoreC10d"]


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class CoordStoreC10d(dist.Store):  # type: ignore[misc,name-defined]
    """c10d keys ``k`` live at ``{prefix}{k}`` in ``store``. Keep a Python reference for
    as long as a group uses it: torch holds only the C++ side, and a collected subclass
    answers every call with "Not implemented" (GenerationGroup keeps it)."""

    def __init__(self, store: Store, prefix: str, timeout: timedelta) -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix
        self._timeout = timeout

    def _k(self, key: str) -> str:
        return self._prefix + key

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def set(self, key: str, value: Any) -> None:
        self._store.put(self._k(key), _bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self._store.get(self._k(key))
        if kv is None:  # deleted between wait and get
            raise LookupError(f"c10d key {key!r} vanished")
        return kv.value

    def check(self, keys: list[str]) -> bool:
        return all(self._store.get(self._k(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = 0.001
        for key in keys:
            while self._store.get(self._k(key)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"c10d key {key!r} not set within {limit:.0f}s")
                time.sleep(pause)
                pause = min(pause * 2, 0.02)

    def add(self, key: str, amount: int) -> int:
        k = self._k(key)
        while True:
            kv = self._store.get(k)
            value = (int(kv.value) if kv is not None else 0) + int(amount)
            rev = kv.mod_revision if kv is not None else 0
            cmp = [Compare(k, "mod_revision", "==", rev)]
            if self._store.txn(cmp, [Put(k, str(value).encode())]).succeeded:
                return value

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        k = self._k(key)
        want, new = _bytes(expected), _bytes(desired)
        while True:
            kv = self._store.get(k)
            if kv is None and want:
                return want  # c10d: an absent key with a non-empty expectation is left alone
            if kv is not None and kv.value != want:
                return kv.value
            rev = kv.mod_revision if kv is not None else 0
            if self._store.txn([Compare(k, "mod_revision", "==", rev)], [Put(k, new)]).succeeded:
                return new

    def delete_key(self, key: str) -> bool:
        return self._store.delete(self._k(key)) > 0

    def num_keys(self) -> int:
        return len(self._store.range(self._prefix).kvs)
