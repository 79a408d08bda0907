"""runtime/rejoin/_loops.py: in-place recoveries that fail alike end in one line, not a loop."""

from __future__ import annotations

import pytest

from stalwart.errors import RecoveryLoopError
from stalwart.runtime.rejoin._loops import RecoveryLoops

STEP_44 = "collective failed in step 44: Timed out waiting 60000ms for recv"


def _round(
    loops: RecoveryLoops,
    reason: str,
    failed: tuple[int, ...],
    formed: tuple[int, ...],
    ended_for: str | None = None,
) -> None:
    """A failure (the generation ended by a member for ``ended_for``, by default this
    same failure) and the next formation."""
    loops.failed(reason, failed, same_cause=reason if ended_for is None else ended_for)
    loops.formed(formed)


def test_a_step_failing_alike_twice_with_nothing_changed_raises_one_line() -> None:
    loops = RecoveryLoops()
    # rank 0 killed in step 45, replaced (pid 12): the first failure changed something
    _round(loops, "collective failed in step 45: Connection closed by peer", (10, 11), (12, 11))
    _round(loops, STEP_44, (12, 11), (12, 11))  # the redone step 44 fails: once
    with pytest.raises(RecoveryLoopError) as err:
        _round(loops, "collective failed in step 44: Connection closed", (12, 11), (12, 11))
    line = str(err.value)
    assert "\n" not in line and line.startswith("collective failed in step 44, 2 times in a row")
    assert "Connection closed" in line and "events.jsonl" in line


def test_a_member_lost_or_replaced_or_another_step_starts_the_count_again() -> None:
    """A rank that dies at the same step every time is the agent's crash loop (its
    verdict names the rank and its error): the survivors never pre-empt it; nor a
    generation that failed because a member was still dying when it formed (a lost
    node): the one after it has another pid."""
    loops = RecoveryLoops()
    for old, new in (((10, 11), (12, 11)), ((12, 11), (13, 11)), ((13, 11), (14, 11))):
        _round(loops, STEP_44, old, new)
    _round(loops, STEP_44, (14, 11), (14, 11))  # 1
    _round(loops, STEP_44, (14, 11), (15, 11))  # the member died meanwhile: 0
    _round(loops, STEP_44, (15, 11), (15, 11))  # 1
    _round(loops, "collective failed in step 43: x", (15, 11), (15, 11))  # another: 1
    _round(loops, STEP_44, (15, 11), ())  # members unknown (elastic): 0
    loops.formed((15, 11))  # a formation with no failure before it (a grow) counts nothing
    _round(loops, STEP_44, (15, 11), (15, 11))
    with pytest.raises(RecoveryLoopError):
        _round(loops, STEP_44, (15, 11), (15, 11))


def test_a_generation_the_agent_ended_is_no_loop() -> None:
    """A lost node or a fenced agent: the coordinator's record says why the job moved
    on, and this member's step only failed because the generation was left; the same
    processes forming again is no sign of a loop (the lost ones leave later)."""
    loops = RecoveryLoops()
    left = "collective failed in step 116: generation 2 was left while a collective waited"
    for _ in range(4):
        _round(loops, left, (20, 21, 22, 23), (20, 21, 22, 23), "node 1 lost")
    # the member's own failure, recorded by another member for the same step, counts
    _round(loops, STEP_44, (1, 2), (1, 2), "collective failed in step 44: Connection closed")
    with pytest.raises(RecoveryLoopError):
        _round(loops, left.replace("116", "44"), (1, 2), (1, 2), STEP_44)
