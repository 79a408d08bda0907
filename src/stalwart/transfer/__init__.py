"""Live snapshot transfer: stream a complete shared-memory slot to another process.

Used by elastic joins (a joiner receives the survivors' state from memory, issue 4) and
by peer memory replicas (an agent streams its node's snapshots to a buddy node in the
background under a bandwidth cap, issue 7). TCP, chunked, xxh3-128 per chunk,
authenticated with the job token, nothing unpickled; protocol in docs/transfer.md.
Imports no torch.
"""

from __future__ import annotations

from stalwart.transfer._wire import PROTOCOL, VERSION, Pacer
from stalwart.transfer.errors import (
    ChunkMismatchError,
    SourceChangedError,
    TransferAuthError,
    TransferError,
    TransferProtocolError,
)
from stalwart.transfer.handoff import StateRequest, request_state, serve_requests
from stalwart.transfer.receiver import ReceiverConfig, ReceiveResult, SlotReceiver
from stalwart.transfer.replicate import ReplicaConfig, Replicator
from stalwart.transfer.sender import SendConfig, SendResult, send_slot

__all__ = [
    "PROTOCOL",
    "VERSION",
    "ChunkMismatchError",
    "Pacer",
    "ReceiveResult",
    "ReceiverConfig",
    "ReplicaConfig",
    "Replicator",
    "SendConfig",
    "SendResult",
    "SlotReceiver",
    "SourceChangedError",
    "StateRequest",
    "TransferAuthError",
    "TransferError",
    "TransferProtocolError",
    "request_state",
    "send_slot",
    "serve_requests",
]
