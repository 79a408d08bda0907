"""Store layout of an elastic job (``--strategy elastic``), shared by the agents and the
workers; imports no torch (the agent never does)."""

from __future__ import annotations

from stalwart.coordinator.store import Store

__all__ = ["Keys", "alive_members", "replica_root"]


class Keys:
    """Store keys of one elastic job (all under ``/stalwart/<job>/el/``)."""

    def __init__(self, job: str) -> None:
        self.root = f"/stalwart/{job}/el/"
        self.alive = self.root + "alive/"  # <member> -> incarnation (the agent's)
        self.join = self.root + "join/"  # <member> -> JoinRequest
        self.roster = self.root + "roster/"  # <gen> -> [[member, inc], ...] (decided)
        self.admit = self.root + "admit/"  # <gen> -> [{member, inc, step, digest}, ...]
        self.failed = self.root + "failed"  # why the job cannot go on (the agent ends it)
        self.finished = self.root + "finished"  # the group trained to the end
        self.sharded = self.root + "sharded"  # FSDP2: resized by restarts (runtime/comm/_fsdp.py)
        self.info = f"/stalwart/{job}/rt/"  # <gen>/<member> -> a member's join info

    def member(self, prefix: str, member: int) -> str:
        return f"{prefix}{member:06d}"

    def gen(self, prefix: str, generation: int) -> str:
        return f"{prefix}{generation:012d}"


def alive_members(store: Store, keys: Keys) -> dict[int, str]:
    """member -> incarnation of every live member (maintained by the agents)."""
    return {int(kv.key.rsplit("/", 1)[1]): kv.value.decode() for kv in store.range(keys.alive).kvs}


def replica_root(job: str) -> str:
    """Where ``--strategy async`` keeps its rounds (runtime/replica_groups/_rounds.py): the agent
    deletes ``<root>m/alive/<group>`` when a group's worker exits."""
    return f"/stalwart/{job}/async/"
