"""The hang bound for jobs of slow steps (issue 28): a step of seconds, or a long first
step (a compile, a first batch from far away), is never a hang, and a real hang is found
within a bound that does not grow with the step time when it is certain (a stopped
process) and is learned from the step time when it is not (agent/detection/hang.py)."""

from __future__ import annotations

from stalwart.agent import Activity, HangConfig, find_hang
from stalwart.agent.detection.dataplane import find_stall
from stalwart.contract.board import Slot

CFG = HangConfig(floor_s=1.0, k=3.0, idle_s=20.0, ceiling_s=300.0)
NOW = 1000.0


def slot(phase: str, t_progress: float, p99: float, *, observed: bool = False) -> Slot:
    return Slot(1, 10, phase, 0, t_progress, NOW, p99, not observed, observed)


def idle(since: float) -> Activity:
    return Activity("S", t_busy=since)


def busy(now: float = NOW) -> Activity:
    return Activity("R", t_busy=now)


def stopped(at: float) -> Activity:
    return Activity("T", t_busy=at, t_stopped=at)


def test_slow_steps_that_compute_are_never_a_hang() -> None:
    # 3 s steps, rank 0 three steps' worth into one: busy, its peer waits for it
    slots = {0: slot("step", NOW - 9, p99=3.0), 1: slot("collective", NOW - 9, p99=3.0)}
    assert find_hang(slots, NOW, CFG, {0: busy(), 1: idle(NOW - 9)}, whole_job=True) is None


def test_a_slow_step_that_waits_is_judged_by_its_learned_bound() -> None:
    # 10 s steps spent waiting (a device sync that sleeps, a far data store): idle, but
    # within k x p99 = 30 s, above --hang-idle 20: not stuck yet
    slots = {0: slot("step", NOW - 25, p99=10.0), 1: slot("collective", NOW - 25, p99=10.0)}
    act = {0: idle(NOW - 25), 1: idle(NOW - 25)}
    assert find_hang(slots, NOW, CFG, act, whole_job=True) is None
    verdict = find_hang(slots, NOW + 6, CFG, act, whole_job=True)  # 31 s > 30 s
    assert verdict is not None and verdict.ranks == [0] and verdict.threshold_s == 30.0


def test_a_long_first_step_is_never_judged_by_step_time() -> None:
    # no step time known yet (p99 0, no history): a compile computes, never a hang; a
    # worker that has not stepped yet ("starting") is never judged idle
    first = {0: slot("step", NOW - 600, p99=0.0), 1: slot("collective", NOW - 600, p99=0.0)}
    assert find_hang(first, NOW, CFG, {0: busy(), 1: idle(NOW - 600)}, whole_job=True) is None
    starting = {0: Slot(7, 0, "starting", 0, NOW - 600, 0.0, 0.0, False, False)}
    assert find_hang(starting, NOW, CFG, {0: idle(NOW - 600)}, whole_job=True) is None


def test_a_stopped_rank_of_slow_steps_is_found_after_the_floor() -> None:
    # the torchtitan port: 5 s steps, SIGSTOP found 19.7 s later when the bound was
    # 3 x p99; the process cannot move, so its step time is no reason to wait
    slots = {0: slot("collective", NOW - 4, p99=5.0), 1: slot("step", NOW - 4, p99=5.0)}
    assert find_hang(slots, NOW, CFG, {0: idle(NOW - 4), 1: stopped(NOW - 0.9)}) is None
    verdict = find_hang(slots, NOW, CFG, {0: idle(NOW - 4), 1: stopped(NOW - 1.1)})
    assert verdict is not None and verdict.ranks == [1] and verdict.threshold_s == 1.0
    assert CFG.stopped_threshold() == CFG.floor_s < CFG.threshold(5.0) == 15.0


def test_a_stopped_rank_in_its_first_step_is_found_after_the_floor_too() -> None:
    slots = {0: slot("collective", NOW - 60, p99=0.0), 1: slot("step", NOW - 60, p99=0.0)}
    verdict = find_hang(slots, NOW, CFG, {0: idle(NOW - 60), 1: stopped(NOW - 1.5)})
    assert verdict is not None and verdict.ranks == [1]


def test_a_cut_data_plane_is_probed_after_the_floor_whatever_the_step_time() -> None:
    # every rank waits in a collective: a remote peer may compute a slow step, but the
    # probe tells that from a cut (its agent answers), so the probe starts after the
    # floor, not after k x p99 (15 s here; 104.8 s for elastic at load 35, issue 25)
    slots = {0: slot("collective", NOW - 2, p99=5.0), 1: slot("collective", NOW - 2, p99=5.0)}
    act = {0: idle(NOW - 5), 1: idle(NOW - 5)}
    assert find_stall(slots, NOW - 1.5, CFG, act) is None  # 0.5 s < the 1 s floor
    stall = find_stall(slots, NOW, CFG, act)
    assert stall is not None and stall.threshold_s == CFG.floor_s
