from __future__ import annotations

from stalwart.agent import HangConfig, Slot, find_hang

CFG = HangConfig(floor_s=1.0, k=3.0, alive_s=0.5)


def slot(phase: str, t_progress: float, t_alive: float, p99: float = 0.1) -> Slot:
    return Slot(1, 10, phase, 0, t_progress, t_alive, p99, True)


def test_no_hang_while_progressing() -> None:
    slots = {0: slot("step", 99.5, 99.95), 1: slot("collective", 99.6, 99.95)}
    assert find_hang(slots, 100.0, CFG) is None


def test_stopped_worker_is_the_culprit() -> None:
    # rank 1 stopped at 98.5; rank 0 waits in the collective with a fresh heartbeat
    slots = {0: slot("collective", 98.6, 99.95), 1: slot("step", 98.5, 98.5)}
    verdict = find_hang(slots, 100.0, CFG)
    assert verdict is not None and verdict.ranks == [1]
    assert verdict.threshold_s == 1.0


def test_threshold_scales_with_p99() -> None:
    slots = {0: slot("collective", 98.0, 99.95, p99=1.0), 1: slot("step", 98.0, 98.0, p99=1.0)}
    assert find_hang(slots, 100.0, CFG) is None  # 2 s < 3 x 1 s
    slots[0] = slot("collective", 98.0, 101.45, p99=1.0)
    verdict = find_hang(slots, 101.5, CFG)
    assert verdict is not None and verdict.ranks == [1] and verdict.threshold_s == 3.0


def test_live_deadlock_blames_the_computing_rank() -> None:
    slots = {0: slot("collective", 98.0, 99.95), 1: slot("step", 98.0, 99.95)}
    verdict = find_hang(slots, 100.0, CFG)
    assert verdict is not None and verdict.ranks == [1]


def test_recovery_resets_the_clock() -> None:
    slots = {0: slot("collective", 98.0, 99.95), 1: slot("step", 98.0, 98.0)}
    assert find_hang(slots, 100.0, CFG, since=99.5) is None


def test_waiting_for_a_remote_peer_is_not_a_local_hang() -> None:
    slots = {0: slot("collective", 98.0, 99.95), 1: slot("collective", 98.0, 99.95)}
    assert find_hang(slots, 100.0, CFG) is None
    verdict = find_hang(slots, 98.0 + CFG.ceiling_s + 1, CFG)
    assert verdict is not None and verdict.ranks == [0, 1]


def test_unknown_step_time_waits_for_the_ceiling() -> None:
    slots = {0: slot("step", 0.0, 0.0, p99=0.0)}
    assert find_hang(slots, 100.0, CFG) is None
    assert find_hang({0: slot("recovering", 0.0, 0.0)}, 1e6, CFG) is None


def test_a_plain_scripts_observed_slot_is_watched_and_an_unknown_one_is_not() -> None:
    stopped = Slot(1, 10, "step", 0, 98.5, 98.5, 0.1, False, True)  # observed, no runtime
    waiting = Slot(2, 10, "step", 0, 98.6, 99.95, 0.1, False, True)
    verdict = find_hang({0: waiting, 1: stopped}, 100.0, CFG)
    assert verdict is not None and verdict.ranks == [1]
    unknown = Slot(1, 10, "step", 0, 98.5, 98.5, 0.1, False, False)  # neither: not watched
    assert find_hang({1: unknown}, 100.0, CFG) is None
