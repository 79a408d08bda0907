"""Sharded (FSDP2, DTensor) state on disk: one multi-rank checkpoint, committed once.

A DDP job has one copy of its state to persist (rank 0's). A sharded job has none: each
rank holds only its shard of the parameters and optimizer moments. So every rank
persists its own shard, at the same step-fixed points, into one checkpoint root
(``<run>/ckpt``) in the engine's multi-rank format: its pack and its index
``step_<S>/rank_<R>.json`` (docs/checkpoint-format.md). The step becomes visible with
one manifest that lists every rank's index, written once every rank's index exists.

Who writes it: the last rank to finish. Each rank, once its index is durable, records
that in the job's store (:meth:`ShardedCommit.written`); the rank whose record completes
the set, and wins a compare-and-swap on the step's claim key, commits the step through
the one commit path (:class:`stalwart.checkpoint.StepCommitter`), fenced by the
coordinator's generation record. Nobody waits for anyone: a rank that is not last
returns at once, and a step some rank never wrote (it died, or skipped that persist
because its previous one was still running) is never committed and is collected later
as an uncommitted leftover. A member of an old generation cannot commit: the claim is
per generation, and the commit itself is fenced.

Restoring such a checkpoint at another world size reshards it (each rank reads the saved
pieces that overlap its new shard: :func:`stalwart.checkpoint.restore_state`).
"""

from __future__ import annotations

import json
import math
import statistics
from typing import TYPE_CHECKING

from stalwart.coordinator import Compare, Delete, Put
from stalwart.runtime._cadence import parse_every

if TYPE_CHECKING:
    from stalwart.coordinator import Store

__all__ = ["SHARD_NAME", "AutoPersist", "ShardedCommit"]

SHARD_NAME = "sharded"
"""The name of the job's one sharded checkpoint root in the coordinator's commit records."""


class ShardedCommit:
    """The job's record of which ranks have written their index of a step."""

    def __init__(self, store: Store, job: str, launch: int, rank: int, world_size: int) -> None:
        self.store = store
        self.root = f"/stalwart/{job}/sharded/"
        self.launch, self.rank, self.world_size = launch, rank, world_size

    def _step_prefix(self, generation: int, step: int) -> str:
        # the launch too: a relaunched job's workers may reach the same generation number
        return f"{self.root}{self.launch}.{generation:012d}/{step:012d}/"

    def written(self, generation: int, step: int) -> bool:
        """Record that this rank's index of ``step`` is durable; True for exactly one
        member of ``generation``: the one that then commits the step."""
        prefix = self._step_prefix(generation, step)
        self.store.put(prefix + f"rank{self.rank:06d}", b"1")
        kvs = self.store.range(prefix).kvs
        if sum(kv.key[len(prefix) :].startswith("rank") for kv in kvs) < self.world_size:
            return False  # a later rank commits
        claim = prefix + "claim"
        mine = json.dumps({"rank": self.rank}).encode()
        return self.store.txn(
            [Compare(claim, "mod_revision", "==", 0)], [Put(claim, mine)]
        ).succeeded

    def prune(self, generation: int, step: int) -> None:
        """After ``step`` committed: drop the records of older steps and generations (the
        store does not grow with the run). ``step``'s own records stay, so that a late
        member of the same step can never win its claim a second time."""
        keep = self._step_prefix(generation, step)
        stale = {
            kv.key[: kv.key.rindex("/") + 1]
            for kv in self.store.range(self.root).kvs
            if kv.key[: kv.key.rindex("/") + 1] < keep
        }
        if stale:
            self.store.txn([], [Delete(p, prefix=True) for p in sorted(stale)])


class AutoPersist:
    """``--persist-every auto`` for a sharded job: every rank must persist at the same
    steps (a step is committed only when every rank wrote it).

    Rank 0 turns Daly's interval into a step count once and publishes one record for the
    job, ``{"every": k, "from": F}`` at ``/stalwart/<job>/persist-auto``, created only if
    absent (a restarted rank 0 adopts the job's record, it does not choose again), with
    ``F`` two steps after the step it publishes at: the snapshot cadence's scheme
    (runtime/_cadence.py says why every member then knows the record before ``F``). No
    rank persists before it knows the record, and every rank persists the steps
    ``s >= F`` with ``s % k == 0``, so a rank reading it a step late still persists the
    same steps. (The previous scheme published a choice per generation that applied at
    once: a rank that read it late missed persist steps, which then never committed.)"""

    def __init__(self, store: Store | None, job: str, rank: int) -> None:
        self.store, self.rank = store, rank
        self.key = f"/stalwart/{job}/persist-auto"
        self.every: int | None = None
        self.start = 0  # the first step at which ``every`` applies

    def due(self, step: int, interval_s: float, step_s: list[float]) -> bool:
        """Whether ``step`` is a persist point; ``interval_s``: Daly's interval now,
        ``step_s``: recent step durations (rank 0 turns one into steps with the other)."""
        if self.every is None:
            self._learn(step, interval_s, step_s)
        return self.every is not None and step >= self.start and step % self.every == 0

    def _learn(self, step: int, interval_s: float, step_s: list[float]) -> None:
        store = self.store
        if store is None:  # alone: nobody to agree with
            if step_s:
                self.every = _choose(interval_s, step_s)
            return
        found = store.get(self.key)
        if found is None and self.rank == 0 and step_s:
            doc = json.dumps({"every": _choose(interval_s, step_s), "from": step + 2})
            store.txn([Compare(self.key, "mod_revision", "==", 0)], [Put(self.key, doc.encode())])
            found = store.get(self.key)  # the record that won is the job's, ours or not
        if found is not None:
            self.every, self.start = parse_every(found.value, self.key, "--persist-every auto")


def _choose(interval_s: float, step_s: list[float]) -> int:
    return max(1, math.ceil(interval_s / max(statistics.median(step_s), 1e-6)))
