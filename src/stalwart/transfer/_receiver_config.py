"""What a :class:`~stalwart.transfer.SlotReceiver` accepts, and what it reports."""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.contract.shm_names import SHM_DIR
from stalwart.errors import ConfigError

__all__ = ["ReceiveResult", "ReceiverConfig"]


@dataclass(frozen=True)
class ReceiverConfig:
    """Where received slots go and what a sender may ask for."""

    shm_dir: str = SHM_DIR
    slots: int = 2
    host: str = "127.0.0.1"
    port: int = 0
    max_bytes: int = 64 << 30  # largest snapshot accepted
    max_meta_bytes: int = 64 << 20
    io_timeout_s: float = 60.0
    """A stalled sender loses its connection after this: no byte of a chunk for this
    long, or a control frame not complete this long after its first byte."""
    handshake_timeout_s: float = 5.0
    """The whole handshake (hello sent to auth frame received) must end within this."""
    max_connections: int = 64
    """Authenticated senders at once (a buddy's replicator, the survivors of a join)."""
    max_unauthenticated: int = 64
    """Connections not yet authenticated, held apart: a new one evicts the oldest, so
    nobody without the token keeps a sender out (coordinator/admission.py)."""
    max_unauthenticated_per_peer: int = 32
    """Unauthenticated connections from one address (its flood evicts its own)."""
    release_timeout_s: float = 10.0
    """:meth:`SlotReceiver.release` cuts a transfer in flight into the namespace and
    waits this long at most for it to let go (a takeover never waits on a hung peer)."""

    def __post_init__(self) -> None:
        if self.slots < 2:
            raise ConfigError(f"receiver slots={self.slots}: need at least 2 (double buffer)")
        for name in ("io_timeout_s", "handshake_timeout_s", "release_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"ReceiverConfig.{name} must be a positive number of seconds")
        for name in ("max_connections", "max_unauthenticated", "max_unauthenticated_per_peer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ReceiverConfig.{name} must be >= 1")


@dataclass(frozen=True)
class ReceiveResult:
    """One incoming transfer, successful or not (``error`` says why, ``bad_chunks``
    which chunks failed their checksum)."""

    ok: bool
    peer: str
    namespace: str | None = None
    slot: int | None = None
    step: int | None = None
    seq: int | None = None
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    bad_chunks: tuple[int, ...] = ()
