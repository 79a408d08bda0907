"""The node's health endpoint (``stalwart run --health-port``): ``/healthz`` and
``/readyz`` over HTTP, for an orchestrator's liveness and readiness probes (Kubernetes
``httpGet``, a load balancer, a script's ``curl``).

Why a separate endpoint from ``--metrics-port``: metrics are the job's (node 0 serves
them, fed from the run's events), health is the node's own: every node's agent answers
for itself, and an orchestrator restarts or routes by pod, not by job.

- ``/healthz`` (liveness): 200 during start-up (which has its own timeouts) and while
  the agent's monitor loop has turned within ``stale_s``; 503 when it has not (a wedged
  agent: restart the pod). A node the agent
  takes out of the job (a failing health probe, a lost lease) does not linger to fail
  this check: the agent exits (code 3) and the orchestrator sees the exit.
- ``/readyz`` (readiness): 200 once this node's workers run in a generation of the job,
  503 before (rendezvous, zygote start-up, preflight) and while the job ends.

The body is one JSON object ``{"ok": bool, "node": int, "state": str, "detail": str}``
(``state``: ``starting``, ``training``, ``ending``); the format is versioned by its
``"v": 1`` field and documented in docs/launch.md.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.errors import ConfigError
from stalwart.metrics.serve import PathServer

__all__ = [
    "HEALTH_FORMAT_VERSION",
    "HealthEndpoint",
    "HealthEndpointConfig",
    "NodeStatus",
    "serve_health",
]

HEALTH_FORMAT_VERSION = 1


@dataclass(frozen=True)
class HealthEndpointConfig:
    """Where the node's health endpoint listens (off unless ``port`` is set)."""

    port: int | None = None
    """TCP port of ``/healthz`` and ``/readyz`` (0: a free one, printed at start)."""
    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; in a pod, ``0.0.0.0`` so the kubelet, which
    probes the pod's IP, can reach it."""
    stale_s: float = 30.0
    """How long the monitor loop may not turn before ``/healthz`` says 503. The loop
    turns every few tens of milliseconds; a recovery (a restore, a re-formation) holds
    it for seconds at most, so 30 s only fires for an agent that is truly stuck."""

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"--health-port {self.port} is not a TCP port (0-65535)")
        if not self.stale_s > 0:
            raise ConfigError(f"the health staleness bound must be > 0 s, got {self.stale_s}")


class NodeStatus:
    """What the endpoint reports; the agent's loop is its only writer."""

    def __init__(self, node: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self._clock = clock
        self._lock = threading.Lock()
        self._state = "starting"
        self._tick = clock()

    def tick(self) -> None:
        """The monitor loop turned (once per turn): the first turn is the first after
        this node's workers were started, so the node is training from then on."""
        self._tick = self._clock()
        if self._state == "starting":
            with self._lock:
                if self._state == "starting":
                    self._state = "training"

    def ending(self) -> None:
        with self._lock:
            self._state = "ending"

    def live(self, stale_s: float) -> tuple[bool, str]:
        if self.state() == "starting":  # no loop yet; the start-up has its own timeouts
            return True, "starting: rendezvous, worker start-up or preflight"
        idle = self._clock() - self._tick
        if idle > stale_s:
            return False, f"the agent's monitor loop has not turned for {idle:.1f} s"
        return True, f"the monitor loop turned {idle:.2f} s ago"

    def ready(self) -> tuple[bool, str]:
        with self._lock:
            state = self._state
        if state == "training":
            return True, "this node's workers train in the job's current generation"
        if state == "starting":
            return False, "starting: rendezvous, worker start-up or preflight"
        return False, "the job is ending on this node"

    def state(self) -> str:
        with self._lock:
            return self._state


class HealthEndpoint:
    """``/healthz`` and ``/readyz`` over a :class:`NodeStatus` (metrics/serve.py's
    server: bounded connections, no access log)."""

    def __init__(self, status: NodeStatus, cfg: HealthEndpointConfig) -> None:
        self.status, self.cfg = status, cfg
        self._server: PathServer | None = None
        self.port = cfg.port or 0

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}/healthz"

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        """The status code and body for ``path`` (404 for any other path)."""
        path = path.split("?", 1)[0]
        if path == "/healthz":
            ok, detail = self.status.live(self.cfg.stale_s)
        elif path == "/readyz":
            ok, detail = self.status.ready()
        else:
            return 404, {"v": HEALTH_FORMAT_VERSION, "ok": False, "detail": "try /healthz"}
        body = {
            "v": HEALTH_FORMAT_VERSION,
            "ok": ok,
            "node": self.status.node,
            "state": self.status.state(),
            "detail": detail,
        }
        return (200 if ok else 503), body

    def _http(self, path: str) -> tuple[int, str, bytes]:
        code, body = self.answer(path)
        return code, "application/json", json.dumps(body).encode()

    def start(self) -> HealthEndpoint:
        server = PathServer(
            self._http, self.cfg.host, self.port, what="health", flag="--health-port"
        )
        self._server = server.start()
        self.port = server.port
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def serve_health(
    cfg: HealthEndpointConfig, status: NodeStatus, say: Callable[[str], None]
) -> Callable[[], None]:
    """Start the endpoint if ``--health-port`` asked for one; what ends it."""
    if cfg.port is None:
        return lambda: None
    endpoint = HealthEndpoint(status, cfg).start()
    say(f"health at {endpoint.url} (and /readyz)")
    return endpoint.close
