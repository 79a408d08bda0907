"""In-process stand-ins for the agent's parts' collaborators (the zygote, the event log,
the launch record), shared by processes/test_workers.py, cluster/test_generation.py and
strategies/test_policies.py."""

from __future__ import annotations

import uuid
from typing import Any

from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore


class FakeZygote:
    """Records what it is told; the test plays the zygote's answers."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.queue: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)

    def events(self, timeout: float, wake: int | None = None) -> list[dict[str, Any]]:
        out, self.queue = self.queue, []
        return out

    def pid(self) -> int:
        return 0


class FakeEvents:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.records.append((kind, fields))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.records]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, f in self.records if k == kind]


class FakeLaunch:
    """The job's launch record (agent/cluster/_cluster.py's publish/read)."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}

    def publish(self, key: str, record: dict[str, Any]) -> None:
        self.records[key] = dict(record)

    def published(self, key: str) -> dict[str, Any] | None:
        return self.records.get(key)

    def read(self, key: str, timeout: float) -> dict[str, Any]:
        return self.records[key]


def coordinator() -> Coordinator:
    return Coordinator(MemoryStore(), CoordinatorConfig(job_id=f"t-{uuid.uuid4().hex[:8]}"))
