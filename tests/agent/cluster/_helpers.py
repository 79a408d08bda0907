"""What the cluster tests share: a two-node launch config, a store that counts requests."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from stalwart.agent.config import LaunchConfig


def two_node_config(
    tmp: Path, job: str, node: int, endpoint: str, *, lease: float, grace: float | None = None
) -> LaunchConfig:
    """Node ``node`` of a 2-node job whose store is at ``endpoint`` (an empty script)."""
    script = tmp / "train.py"
    script.write_text("")
    extra: dict[str, Any] = {} if grace is None else {"partition_grace_s": grace}
    return LaunchConfig(
        str(script),
        job=job,
        nnodes=2,
        node_rank=node,
        rdzv_endpoint=endpoint,
        node_lease_s=lease,
        token_file=str(tmp / "token"),
        **extra,
    )


class CountingStore:
    """A store (or store client) counting every request made through it: each call, and
    each ``get`` of a watch it opened (one long-poll or stream read); ``events``: what
    those watches delivered."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.requests, self.events = inner, 0, 0
        self._lock = threading.Lock()

    def count(self, events: int = 0) -> None:
        with self._lock:
            self.requests += 1
            self.events += events

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr) or name == "close":
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count()
            out = attr(*args, **kwargs)
            return _CountedWatch(out, self) if name == "watch" else out

        return counted


class _CountedWatch:
    def __init__(self, inner: Any, owner: CountingStore) -> None:
        self.inner, self.owner = inner, owner

    def get(self, timeout: float | None = None) -> Any:
        out = self.inner.get(timeout)
        self.owner.count(len(out))  # a long-poll, and the events it carried
        return out

    def close(self) -> None:
        self.inner.close()
