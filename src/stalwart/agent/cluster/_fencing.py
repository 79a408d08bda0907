"""This agent's lease as the agent knows it, and what a lost one means: it is fenced.

An agent that lost its lease (SIGSTOPped, partitioned, starved, cut from the coordinator
only) was declared lost while it was unresponsive: the leader bumped the generation and
adopted its ranks. It must not restart or replace any worker (those ranks run elsewhere
now), nor move the job's generation: every bump it makes is one transaction checked
against its lease (coordinator/fence.py), and its workers' joins and bumps are checked
against the same member key (the contract's ``fence``, runtime/comm/_coord.py). It learns it
is fenced from whichever comes first: the heartbeat thread finding the lease gone, a
probe of its member key before any recovery, a bump refused, or the coordinator not
answering for longer than the lease (agent/cluster/_link.py bounds every call).
Then the agent stops its workers and exits 3 (docs/launch.md).

The one exception is a lease that *expired* (the heartbeat thread found it gone or could
not renew it) while nothing else happened: the partition grace (``--partition-grace``,
agent/cluster/_grace.py, docs/detection.md). The lease is then *missing*, not lost: until a
deadline on this node's clock the agent tries to join again as the same node, which the
store allows only while the majority has not declared it lost (blocklisted) in the same
transaction that checks the member key is absent. Rejoined, nothing here moved and the
job goes on; past the deadline, or blocklisted, it is fenced as above.
"""

from __future__ import annotations

from typing import Any

from stalwart.errors import StalwartError

__all__ = ["NodeFenced", "NodeLease"]


class NodeFenced(StalwartError):
    """This node's lease is gone: another node runs its ranks now."""


class NodeLease:
    """The one owner of why this node's lease is gone (None: we hold it)."""

    def __init__(self, node: int) -> None:
        self.node = node
        self.key = ""  # our member key, set once joined
        self.revision = 0  # its create_revision: a rejoin would make another
        self.lost_reason: str | None = None
        self.missing: tuple[str, float] | None = None
        """(why, deadline on time.monotonic()): the lease expired and the agent may
        still rejoin until the deadline (the partition grace); None otherwise."""

    def joined(self, key: str, revision: int) -> None:
        self.key, self.revision, self.missing = key, revision, None

    def expired(self, reason: object, deadline: float) -> None:
        """The heartbeat found the lease gone (or could not renew it for its TTL): missing
        until ``deadline``, unless already lost."""
        if self.lost_reason is None and self.missing is None:
            self.missing = (str(reason), deadline)

    def lost(self, reason: object) -> None:
        """The heartbeat thread found the lease gone, or a bump was refused."""
        if self.lost_reason is None:
            self.lost_reason = str(reason)
            self.missing = None

    def probe(self, store: Any) -> bool:
        """Ask the store whether our member key still is the one we created (a bounded
        call: agent_client_config); True when the lease is gone."""
        if self.lost_reason is None and self.key:
            kv = store.get(self.key)
            if kv is None or kv.create_revision != self.revision:
                self.lost("this node's lease expired (its member key is gone)")
        return self.lost_reason is not None

    def error(self) -> NodeFenced:
        return NodeFenced(
            f"node {self.node} was fenced: {self.lost_reason}; its ranks were adopted by "
            "another node. Its workers are stopped and it leaves the job (exit 3; start "
            "a new agent once the job can use more nodes)"
        )

    def unreachable(self, address: str, err: BaseException) -> NodeFenced:
        """The coordinator did not answer for longer than the lease: the lease expired
        there (or will before we could act), so this node is fenced, not misconfigured."""
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        self.lost(f"the coordinator at {address} did not answer ({first})")
        return self.error()
