"""Coordinator: membership, generations, blocklist and commits over a ``Store``.

``Store`` is an etcd-v3-shaped key-value interface; :class:`MemoryStore` is the
in-process implementation, :class:`StoreServer`/:class:`StoreClient` serve it over
authenticated TCP (docs/wire-protocol.md), and :class:`EtcdStore` keeps it in a real
etcd cluster (docs/etcd.md).
"""

from __future__ import annotations

from stalwart.coordinator.client import StoreClient, StoreClientConfig
from stalwart.coordinator.coordinator import (
    BlockEntry,
    CheckpointRecord,
    Coordinator,
    CoordinatorConfig,
    GenerationChange,
    StepRecord,
    generation_end,
)
from stalwart.coordinator.errors import (
    AlreadyCommittedError,
    AuthenticationError,
    BlocklistedError,
    CompactedError,
    CoordinatorError,
    FrameTooLargeError,
    LeaseNotFoundError,
    MemberExistsError,
    ProtocolError,
    RendezvousTimeoutError,
    StoreClosedError,
    StoreError,
    StoreUnavailableError,
    TokenFileError,
)
from stalwart.coordinator.etcd import (
    EtcdSecurity,
    EtcdStore,
    EtcdStoreConfig,
    EtcdTarget,
    etcd_url,
    parse_etcd_url,
)
from stalwart.coordinator.fence import Fence
from stalwart.coordinator.membership import Member, MemberEvent, MemberInfo, MembershipWatch
from stalwart.coordinator.memory import MemoryStore
from stalwart.coordinator.server import StoreServer, StoreServerConfig
from stalwart.coordinator.store import (
    Compare,
    Delete,
    Event,
    KeyValue,
    Op,
    Put,
    RangeResult,
    Store,
    TxnResult,
    Watch,
    iter_events,
    wait_for,
)
from stalwart.coordinator.token import (
    check_token,
    create_token_file,
    read_token_file,
    token_check,
)

__all__ = [
    "AlreadyCommittedError",
    "AuthenticationError",
    "BlockEntry",
    "BlocklistedError",
    "CheckpointRecord",
    "CompactedError",
    "Compare",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorError",
    "Delete",
    "EtcdSecurity",
    "EtcdStore",
    "EtcdStoreConfig",
    "EtcdTarget",
    "Event",
    "Fence",
    "FrameTooLargeError",
    "GenerationChange",
    "KeyValue",
    "LeaseNotFoundError",
    "Member",
    "MemberEvent",
    "MemberExistsError",
    "MemberInfo",
    "MembershipWatch",
    "MemoryStore",
    "Op",
    "ProtocolError",
    "Put",
    "RangeResult",
    "RendezvousTimeoutError",
    "StepRecord",
    "Store",
    "StoreClient",
    "StoreClientConfig",
    "StoreClosedError",
    "StoreError",
    "StoreServer",
    "StoreServerConfig",
    "StoreUnavailableError",
    "TokenFileError",
    "TxnResult",
    "Watch",
    "check_token",
    "create_token_file",
    "etcd_url",
    "generation_end",
    "iter_events",
    "parse_etcd_url",
    "read_token_file",
    "token_check",
    "wait_for",
]
