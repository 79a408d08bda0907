"""The worker side of a standby (agent/processes/_standby.py): park before the first step.

A standby runs the training script as the rank it may one day take over: imports,
model and optimizer construction, ``sess.track(...)``, all of it before anything fails.
It stops at the top of ``sess.steps()``: it has not opened the rank's snapshot slots
(on this host they may still be the live rank's, or about to become a buddy's replica),
started a persister, joined a group or written a checkpoint, so a standby that is never
used leaves no trace. The agent activates it by creating the file named in
its contract's ``standby``; the worker then opens its slots and joins the recovery like a
freshly started replacement, only without the set-up.

Why a file and a 5 ms poll: a stat on tmpfs costs microseconds, needs no handler inside
the script's main thread (as a signal would), and the file survives a race in which the
agent activates the standby before it has reached ``steps()``.

While parked, a standby also *preloads*: when this node holds a buddy replica of its rank
(``--replica-rate``: the adopter is the buddy), it copies each new complete replica into
its own state. If the node is lost, the recovery agrees on a step the replica holds,
almost always the one preloaded, and the standby's restore is then no copy at all (the
node-loss benchmark: the restore of the lost ranks, 0.1-0.2 s of a 0.45 s RTO with
512 MB per node on 2 cores, goes; the survivors restore alone). Trade-off: one memcpy of
the rank's state per replica received (one per snapshot interval), on the adopter's
cores, while nothing fails. The copy is checked like a seqlock: the slot is pinned (the
receiver writes the other one), and a meta that changed during the copy discards it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.checkpoint.slots import SlotFiles, latest_complete, pin_slot, unpin_slot
from stalwart.contract.shm_names import SlotNames

__all__ = ["Preload", "park"]

_POLL_S = 0.005
_PRELOAD_EVERY = 10  # look for a new replica every 10th poll (50 ms)
_SLOTS = 2  # a replica receiver's double buffer (transfer.ReceiverConfig.slots)


@dataclass
class Preload:
    """What a parked standby copied into its state from its rank's replica.

    ``seq``/``step``: the replica snapshot its state now equals (None: none does).
    ``touched``: its state is no longer the script's initial state (a copy was made, or
    began and was discarded), so it must not start a job from step 0."""

    names: SlotNames
    rank: int
    seq: int | None = None
    step: int | None = None
    touched: bool = False

    def holds(self, directory: str, step: int) -> bool:
        """Whether the state already equals the newest complete slot of ``step`` in
        ``directory`` (the replica's slots, taken over as the rank's own)."""
        if self.seq is None or self.step != step:
            return False
        newest = latest_complete(directory, _SLOTS, step)
        return newest is not None and newest[1].seq == self.seq

    def poll(self, state: Any) -> None:
        """Copy the newest complete replica into ``state`` if it is not there yet."""
        from stalwart.checkpoint.snapshot import load_slot

        directory = self.names.replica_dir(self.rank)
        found = latest_complete(directory, _SLOTS)
        if found is None or found[1].seq == self.seq:
            return
        index, meta = found
        try:
            pin = pin_slot(directory, index)  # the receiver writes the other slot now
        except FileNotFoundError:
            return  # taken over or removed meanwhile
        slot = SlotFiles(directory, index)
        own = self.names.rank_dir(self.rank)
        try:
            again = slot.read_meta()  # a writer that chose it before the pin unlinks it
            if again is None or again.seq != meta.seq:
                return
            self.seq = self.step = None
            self.touched = True
            load_slot(slot, meta, state)
            # unchanged: no writer touched the slot meanwhile (or it was taken over
            # during the copy, and its files moved to the rank's own directory; only
            # then: on one host, that name may still be the live rank's own slots)
            after = slot.read_meta()
            if after is None and not os.path.isdir(directory):
                after = SlotFiles(own, index).read_meta()
            if after is not None and after.seq == meta.seq:
                self.seq, self.step = meta.seq, meta.step
        finally:
            unpin_slot(pin)
            unpin_slot(os.path.join(own, os.path.basename(pin)))


def park(
    path: str, preload: Preload, state: Any, publish: Callable[[str], None], poll_s: float = _POLL_S
) -> float:
    """Wait until the activation file ``path`` exists, preloading ``state`` from the
    rank's replica meanwhile; returns how long this standby was parked.

    The worker's heartbeat keeps running meanwhile (the agent's board shows it alive),
    and it is killed by its agent if never needed: there is no timeout here."""
    # imported now, not after the activation (27 ms here, more under load): the
    # standby opens its checkpoints with them then (runtime/state/_tracking.py)
    from stalwart.checkpoint import CheckpointManager, SnapshotConfig  # noqa: F401

    publish("standby")
    t0 = time.monotonic()
    polls = 0
    while not os.path.exists(path):
        if polls % _PRELOAD_EVERY == 0:
            preload.poll(state)
        polls += 1
        time.sleep(poll_s)
    with contextlib.suppress(OSError):
        os.unlink(path)  # read once; nothing left in /dev/shm
    return time.monotonic() - t0
