"""The persister client never leaves a save waiting forever."""

from __future__ import annotations

import io
from concurrent.futures import Future

import pytest

from stalwart.checkpoint.persist import Persister, PersistResult
from stalwart.errors import CheckpointError


def _pending(p: Persister, rid: int) -> Future[PersistResult]:
    fut: Future[PersistResult] = Future()
    p._futures[rid] = fut
    return fut


def test_a_reply_is_delivered_and_an_unreadable_one_fails_what_is_pending() -> None:
    p = Persister()
    done, waiting = _pending(p, 1), _pending(p, 2)
    reply = (
        '{"ok": true, "id": 1, "step": 5, "written_bytes": 3, "total_bytes": 3, '
        '"seconds": 0.1, "committed": true}\n'
    )
    p._read(io.StringIO(reply + "not json\n"))
    assert done.result(timeout=1).step == 5
    with pytest.raises(CheckpointError, match="could not be read"):
        waiting.result(timeout=1)
    # later saves are refused with the reason (submit checks it) until a restart
    assert p._broken is not None and "could not be read" in p._broken


def test_the_process_exiting_fails_what_is_pending() -> None:
    p = Persister()
    waiting = _pending(p, 7)
    p._read(io.StringIO(""))
    with pytest.raises(CheckpointError, match="exited"):
        waiting.result(timeout=1)
