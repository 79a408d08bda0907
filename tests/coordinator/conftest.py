"""Fixtures for the coordinator tests, including the Store backends of the conformance suite.

To add a backend, append its name to ``STORE_BACKENDS`` and add a branch to
``_open_backend`` that starts it (skipping with a clear reason only when its server
binary is absent locally) and yields a ``Backend``. The etcd backend starts a fresh
etcd per test (etcd_server.py): revisions are global in etcd, and the suite checks
exact revision arithmetic.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from stalwart.coordinator import (
    MemoryStore,
    Store,
    StoreClient,
    StoreClientConfig,
    StoreServer,
    StoreServerConfig,
)
from stalwart.coordinator.etcd import EtcdStore, EtcdStoreConfig

from .etcd_secure import running_secure_etcd
from .etcd_server import running_etcd

TOKEN = b"0123456789abcdef0123456789abcdef"

# etcd-tls: a real etcd with TLS, client certificates and auth on, the store logged in as
# a user whose role grants only the job's prefix (etcd_secure.py)
STORE_BACKENDS = ["memory", "tcp", "etcd", "etcd-tls"]


@dataclass
class Backend:
    """A running Store backend: ``store`` plus a way to open more clients of it."""

    name: str
    store: Store
    short_ttl: float  # shortest lease TTL the backend honours (etcd rounds up to seconds)
    _new_client: Callable[[], Store]
    _opened: list[Store] = field(default_factory=list)

    def new_client(self) -> Store:
        """Another client of the same store (for MemoryStore: the same object)."""
        client = self._new_client()
        if client is not self.store:
            self._opened.append(client)
        return client


def client_config(**overrides: float) -> StoreClientConfig:
    base: dict[str, float] = {"connect_timeout": 2.0, "request_timeout": 10.0}
    base["reconnect_timeout"] = 5.0
    base.update(overrides)
    return StoreClientConfig(**base)  # type: ignore[arg-type]


def etcd_config(**overrides: float) -> EtcdStoreConfig:
    base: dict[str, float] = {"connect_timeout": 2.0, "request_timeout": 10.0}
    base["reconnect_timeout"] = 10.0
    base.update(overrides)
    return EtcdStoreConfig(**base)  # type: ignore[arg-type]


@contextlib.contextmanager
def _open_backend(name: str) -> Iterator[Backend]:
    if name == "memory":
        mem = MemoryStore()
        yield Backend(name, mem, 0.5, lambda: mem)
        mem.close()
    elif name == "tcp":
        with StoreServer(TOKEN, StoreServerConfig()) as server:
            port = server.port

            def connect() -> Store:
                return StoreClient("127.0.0.1", port, TOKEN, client_config())

            backend = Backend(name, connect(), 0.5, connect)
            try:
                yield backend
            finally:
                for client in [backend.store, *backend._opened]:
                    client.close()
    elif name == "etcd":
        with running_etcd() as etcd:

            def connect_etcd() -> Store:
                return EtcdStore([("127.0.0.1", etcd.client_port)], "/t/", etcd_config())

            backend = Backend(name, connect_etcd(), 1.0, connect_etcd)
            try:
                yield backend
            finally:
                for client in [backend.store, *backend._opened]:
                    client.close()
    elif name == "etcd-tls":
        with running_secure_etcd() as secure:

            def connect_secure() -> Store:
                return EtcdStore.from_url(secure.url(), etcd_config())

            backend = Backend(name, connect_secure(), 1.0, connect_secure)
            try:
                yield backend
            finally:
                for client in [backend.store, *backend._opened]:
                    client.close()
    else:  # pragma: no cover - a backend named in STORE_BACKENDS without a branch
        raise AssertionError(f"no fixture for store backend {name!r}")


@pytest.fixture(params=STORE_BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    with _open_backend(request.param) as b:
        yield b


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.store


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(TOKEN) as srv:
        yield srv


@pytest.fixture
def client(server: StoreServer) -> Iterator[StoreClient]:
    with StoreClient("127.0.0.1", server.port, TOKEN, client_config()) as c:
        yield c


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes (for non-store conditions)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Every thread a test starts must be stopped by the end of the test."""
    before = set(threading.enumerate())
    yield
    assert wait_until(lambda: not (set(threading.enumerate()) - before), 5.0), (
        f"threads left running: {sorted(t.name for t in set(threading.enumerate()) - before)}"
    )
