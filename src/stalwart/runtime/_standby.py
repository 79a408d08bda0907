"""The worker side of a standby (agent/_standby.py): park before the first step.

A standby runs the training script as the rank it may one day take over: imports,
model and optimizer construction, ``sess.track(...)``, all of it before anything fails.
It stops at the top of ``sess.steps()``: it has not opened the rank's snapshot slots
(on this host they may still be the live rank's, or about to become a buddy's replica),
started a persister, joined a group or written a checkpoint, so a standby that is never
used leaves no trace. The agent activates it by creating the file named in
``STALWART_STANDBY``; the worker then opens its slots and joins the recovery like a
freshly started replacement, only without the set-up.

Why a file and a 5 ms poll: a stat on tmpfs costs microseconds, needs no handler inside
the script's main thread (as a signal would), and the file survives a race in which the
agent activates the standby before it has reached ``steps()``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

__all__ = ["park"]

_POLL_S = 0.005


def park(sess: Any, poll_s: float = _POLL_S) -> float:
    """Wait until the activation file exists; returns how long this standby was parked.

    The worker's heartbeat keeps running meanwhile (the agent's board shows it alive),
    and it is killed by its agent if never needed: there is no timeout here."""
    path = sess.env.standby
    sess._publish("standby")
    t0 = time.monotonic()
    while not os.path.exists(path):
        time.sleep(poll_s)
    with contextlib.suppress(OSError):
        os.unlink(path)  # read once; nothing left in /dev/shm
    return time.monotonic() - t0
