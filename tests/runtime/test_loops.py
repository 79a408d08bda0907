"""runtime/_loops.py: in-place recoveries that fail alike end in one line, not a loop."""

from __future__ import annotations

import pytest

from stalwart.errors import RecoveryLoopError
from stalwart.runtime._loops import RecoveryLoops

STEP_44 = "collective failed in step 44: Timed out waiting 60000ms for recv"


def test_a_step_failing_alike_twice_with_the_same_processes_raises_one_line() -> None:
    loops = RecoveryLoops()
    loops.failed("collective failed in step 45: Connection closed by peer", (10, 11))
    loops.failed(STEP_44, (12, 11))  # rank 0 was replaced: the first of its kind
    with pytest.raises(RecoveryLoopError) as err:
        loops.failed("collective failed in step 44: Connection closed by peer", (12, 11))
    line = str(err.value)
    assert "\n" not in line and line.startswith("collective failed in step 44 again after 1")
    assert "Connection closed by peer" in line and "events.jsonl" in line


def test_a_replaced_member_or_another_step_starts_the_count_again() -> None:
    """A rank that dies at the same step every time is the agent's crash loop (its
    verdict names the rank and its error): the survivors never pre-empt it."""
    loops = RecoveryLoops()
    for pids in ((10, 11), (12, 11), (13, 11), (14, 11)):
        loops.failed(STEP_44, pids)
    loops.failed("collective failed in step 43: x", (14, 11))
    loops.failed(STEP_44, (14, 11))
    loops.failed(STEP_44, ())  # members unknown (an elastic formation): no count
    loops.failed(STEP_44, (14, 11))
    with pytest.raises(RecoveryLoopError):
        loops.failed(STEP_44, (14, 11))
