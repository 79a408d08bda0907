from __future__ import annotations

import pytest

from stalwart.agent import Activity, CpuTracker, HangConfig, find_hang
from stalwart.contract.board import Slot
from stalwart.errors import ConfigError

CFG = HangConfig(floor_s=1.0, k=3.0, idle_s=60.0, ceiling_s=300.0)
NOW = 1000.0


def slot(phase: str, t_progress: float, p99: float = 0.1, *, observed: bool = False) -> Slot:
    return Slot(1, 10, phase, 0, t_progress, NOW, p99, not observed, observed)


def busy(now: float = NOW) -> Activity:
    return Activity("R", t_busy=now)


def idle(since: float) -> Activity:
    return Activity("S", t_busy=since)


def stopped(at: float) -> Activity:
    return Activity("T", t_busy=at, t_stopped=at)


# ------------------------------------------------------------------ the CPU tracker


def feed(tracker: CpuTracker, t0: float, seconds: float, share: float, state: str = "S") -> float:
    """Samples every 0.1 s for ``seconds`` at ``share`` of a core; returns the end time."""
    cpu = getattr(tracker, "_last_raw", None) or 0.0
    t = t0
    for _ in range(round(seconds / 0.1)):
        t += 0.1
        cpu += 0.1 * share
        tracker.update(t, cpu, state)
    return t


def test_tracker_tells_computing_from_waiting() -> None:
    tr = CpuTracker(CFG)
    t = feed(tr, 0.0, 2.0, share=1.0)  # state S, yet a full core: computing
    assert tr.update(t + 0.1, 2.1, "S").t_busy == pytest.approx(t + 0.1)
    t = feed(tr, t + 0.1, 5.0, share=0.002)  # a waiting process's heartbeat thread
    act = tr.update(t + 0.1, 2.2, "S")
    assert t + 0.1 - act.t_busy > 3.5  # idle since about 1 s into the wait


def test_tracker_running_state_is_busy_and_t_state_is_stopped() -> None:
    tr = CpuTracker(CFG)
    feed(tr, 0.0, 3.0, share=0.0)
    assert tr.update(3.1, 0.0, "R").t_busy == 3.1
    act = tr.update(3.2, 0.0, "T")
    assert act.t_stopped == 3.2 and act.t_busy == 3.1
    assert tr.update(3.5, 0.0, "T").t_stopped == 3.2  # since when, not the latest sample
    assert tr.update(3.6, 0.0, "S").t_stopped == 0.0  # SIGCONT


def test_tracker_a_new_process_gets_the_benefit_of_the_doubt() -> None:
    act = CpuTracker(CFG).update(5.0, 0.4, "S")
    assert act.t_busy == 5.0 and act.t_stopped == 0.0


def test_tracker_a_child_that_exits_is_not_negative_progress() -> None:
    tr = CpuTracker(CFG)
    feed(tr, 0.0, 2.0, share=0.0)
    tr.update(2.1, 0.0, "S")
    act = tr.update(2.2, -5.0, "S")  # a loader worker with 5 CPU-s exited
    assert act.t_busy < 2.0


# ------------------------------------------------------------------ stopped workers


def test_a_stopped_rank_is_found_after_the_floor() -> None:
    slots = {0: slot("collective", NOW - 1.5), 1: slot("step", NOW - 1.5)}
    act = {0: idle(NOW - 1.4), 1: stopped(NOW - 1.2)}
    verdict = find_hang(slots, NOW, CFG, act)
    assert verdict is not None and verdict.ranks == [1]
    assert verdict.threshold_s == 1.0 and "stopped" in verdict.how
    act[1] = stopped(NOW - 0.9)  # stopped for less than the floor: a debugger, maybe
    assert find_hang(slots, NOW, CFG, act) is None


def test_a_stopped_ranks_bound_is_the_floor_whatever_its_step_time() -> None:
    # 5 s steps: waiting 3 x p99 = 15 s for a process that cannot move is waste
    slots = {0: slot("collective", NOW - 9, p99=5.0), 1: slot("step", NOW - 9, p99=5.0)}
    act = {0: idle(NOW - 8), 1: stopped(NOW - 1.2)}
    verdict = find_hang(slots, NOW, CFG, act)
    assert verdict is not None and verdict.ranks == [1] and verdict.threshold_s == 1.0


def test_a_replacement_stopped_is_found_after_the_floor_despite_its_ranks_history() -> None:
    slots = {0: slot("collective", NOW - 3, p99=0.0), 1: slot("step", NOW - 3, p99=0.0)}
    act = {0: idle(NOW - 3), 1: stopped(NOW - 2.0)}
    verdict = find_hang(slots, NOW, CFG, act, history={1: 10.0})
    assert verdict is not None and verdict.threshold_s == 1.0


def test_a_stopped_rank_during_recovery_is_found_too() -> None:
    slots = {0: slot("recovering", NOW - 50), 1: slot("recovering", NOW - 50)}
    act = {0: idle(NOW - 5), 1: stopped(NOW - 2)}
    verdict = find_hang(slots, NOW, CFG, act)
    assert verdict is not None and verdict.ranks == [1]


def test_recovery_resets_the_clock() -> None:
    slots = {0: slot("collective", NOW - 2), 1: slot("step", NOW - 2)}
    act = {0: idle(NOW - 2), 1: stopped(NOW - 2)}
    assert find_hang(slots, NOW, CFG, act, since=NOW - 0.5) is None


def test_a_stopped_paused_rank_is_a_hang() -> None:
    slots = {0: slot("collective", NOW - 5), 1: slot("paused", NOW - 5)}
    verdict = find_hang(slots, NOW, CFG, {0: idle(NOW - 5), 1: stopped(NOW - 2)})
    assert verdict is not None and verdict.ranks == [1]


# ------------------------------------------------------------------ busy and paused workers


def test_a_long_eval_on_rank_0_is_never_a_hang() -> None:
    # nanoGPT: rank 0 evaluates (CPU busy) for an hour while rank 1 waits in allreduce
    for elapsed in (1.1, 10.0, 3600.0):
        slots = {0: slot("step", NOW - elapsed), 1: slot("collective", NOW - elapsed)}
        act = {0: busy(), 1: idle(NOW - elapsed)}
        assert find_hang(slots, NOW, CFG, act) is None
        assert find_hang(slots, NOW, CFG, act, whole_job=True) is None


def test_a_plain_scripts_eval_is_never_a_hang_nor_its_waiting_peer() -> None:
    # a plain script's slots say "step" even for the rank waiting inside backward()
    slots = {0: slot("step", NOW - 900, observed=True), 1: slot("step", NOW - 900, observed=True)}
    act = {0: busy(), 1: idle(NOW - 900)}
    assert find_hang(slots, NOW, CFG, act, whole_job=True) is None


def test_a_stale_heartbeat_with_advancing_cpu_is_not_a_hang() -> None:
    # the GIL held by a long C++ call: the heartbeat thread starves, the CPU time runs
    stale = Slot(1, 10, "step", 0, NOW - 5, NOW - 4.0, 0.1, False, True)
    assert find_hang({0: stale}, NOW, CFG, {0: busy()}, whole_job=True) is None


def test_a_paused_rank_is_never_judged_by_step_time() -> None:
    slots = {0: slot("paused", NOW - 5000), 1: slot("collective", NOW - 5000)}
    act = {0: idle(NOW - 5000), 1: idle(NOW - 5000)}  # even an idle pause (a remote eval)
    assert find_hang(slots, NOW, CFG, act, whole_job=True) is None


def test_a_busy_rank_in_a_recent_window_still_counts_as_busy() -> None:
    slots = {0: slot("step", NOW - 400), 1: slot("collective", NOW - 400)}
    act = {0: Activity("S", t_busy=NOW - 0.5), 1: idle(NOW - 400)}
    assert find_hang(slots, NOW, CFG, act, whole_job=True) is None


# ------------------------------------------------------------------ idle workers


def test_a_rank_stuck_outside_a_collective_is_blamed_after_the_idle_limit() -> None:
    slots = {0: slot("step", NOW - 61), 1: slot("collective", NOW - 61)}
    act = {0: idle(NOW - 61), 1: idle(NOW - 61)}
    verdict = find_hang(slots, NOW, CFG, act)
    assert verdict is not None and verdict.ranks == [0] and verdict.threshold_s == 60.0
    late = {0: idle(NOW - 59), 1: idle(NOW - 61)}
    assert find_hang(slots, NOW, CFG, late) is None


def test_the_idle_limit_scales_with_long_steps() -> None:
    slots = {0: slot("step", NOW - 85, p99=30.0), 1: slot("collective", NOW - 85, p99=30.0)}
    act = {0: idle(NOW - 85), 1: idle(NOW - 85)}
    assert find_hang(slots, NOW, CFG, act) is None  # 85 s < 3 x 30 s
    verdict = find_hang(slots, NOW + 6, CFG, act)
    assert verdict is not None and verdict.threshold_s == 90.0


def test_a_deadlock_of_the_whole_job_is_blamed_on_every_rank() -> None:
    slots = {0: slot("collective", NOW - 70), 1: slot("collective", NOW - 70)}
    act = {0: idle(NOW - 70), 1: idle(NOW - 70)}
    verdict = find_hang(slots, NOW, CFG, act, whole_job=True)
    assert verdict is not None and verdict.ranks == [0, 1] and "deadlock" in verdict.how


def test_waiting_for_a_remote_peer_is_left_to_its_agent_until_the_ceiling() -> None:
    slots = {0: slot("collective", NOW - 70), 1: slot("collective", NOW - 70)}
    act = {0: idle(NOW - 70), 1: idle(NOW - 70)}
    assert find_hang(slots, NOW, CFG, act) is None
    verdict = find_hang(slots, NOW + 300, CFG, act)
    assert verdict is not None and verdict.ranks == [0, 1] and "remote" in verdict.how


def test_a_plain_scripts_idle_ranks_are_blamed_only_for_a_whole_job_deadlock() -> None:
    slots = {0: slot("step", NOW - 70, observed=True), 1: slot("step", NOW - 70, observed=True)}
    act = {0: idle(NOW - 70), 1: idle(NOW - 70)}
    assert find_hang(slots, NOW, CFG, act) is None  # the peers may be on another node
    verdict = find_hang(slots, NOW, CFG, act, whole_job=True)
    assert verdict is not None and verdict.ranks == [0, 1]


def test_idle_counts_from_the_last_step_or_recovery() -> None:
    slots = {0: slot("step", NOW - 10), 1: slot("collective", NOW - 10)}
    act = {0: idle(NOW - 500), 1: idle(NOW - 500)}
    assert find_hang(slots, NOW, CFG, act) is None  # a step ended 10 s ago
    slots = {0: slot("step", NOW - 500), 1: slot("collective", NOW - 500)}
    assert find_hang(slots, NOW, CFG, act, since=NOW - 10) is None


def test_a_peer_that_just_left_its_pause_clears_the_rank_that_waited_for_it() -> None:
    """Seen under load: rank 0 leaves a declared 60 s pause (its slot says ``step`` again,
    progress now), rank 1 waited through it outside a collective. Rank 1 was not stuck
    while the job's progress waited on rank 0: it is idle only from the pause's end."""
    slots = {0: slot("step", NOW - 0.01), 1: slot("step", NOW - 61)}
    act = {0: idle(NOW - 61), 1: idle(NOW - 61)}
    assert find_hang(slots, NOW, CFG, act) is None
    verdict = find_hang(slots, NOW + 61, CFG, act)  # nobody moved since: rank 1 is stuck
    assert verdict is not None and verdict.ranks == [0, 1]


def test_a_stopped_process_before_its_first_step_is_a_hang() -> None:
    # a plain script SIGSTOPped in init_process_group: no step written, still certain
    starting = Slot(7, 0, "starting", 0, NOW - 30, 0.0, 0.0, False, False)
    verdict = find_hang({1: starting}, NOW, CFG, {1: stopped(NOW - 2)})
    assert verdict is not None and verdict.ranks == [1]


def test_an_unwatched_or_unsampled_rank_is_never_blamed_for_idling() -> None:
    unknown = Slot(1, 10, "step", 0, NOW - 500, NOW - 500, 0.1, False, False)
    assert find_hang({1: unknown}, NOW, CFG, {1: idle(NOW - 500)}, whole_job=True) is None
    starting = Slot(1, 0, "starting", 0, NOW - 500, 0.0, 0.0, False, False)
    assert find_hang({1: starting}, NOW, CFG, {1: idle(NOW - 500)}, whole_job=True) is None
    assert find_hang({1: slot("step", NOW - 500)}, NOW, CFG, {}) is None
    assert find_hang({0: slot("done", NOW - 500)}, NOW, CFG, {0: stopped(NOW - 100)}) is None


def test_bad_configs_are_refused_with_the_flag_to_fix() -> None:
    with pytest.raises(ConfigError, match="--hang-floor"):
        HangConfig(floor_s=0.0)
    with pytest.raises(ConfigError, match="--hang-idle"):
        HangConfig(floor_s=10.0, idle_s=5.0)


def gen_slot(phase: str, generation: int, t_progress: float) -> Slot:
    return Slot(1, 10, phase, generation, t_progress, NOW, 0.1, True)


def test_a_collective_of_a_generation_the_job_left_is_a_hang() -> None:
    # a silent node's ranks were adopted (generation 3 -> 4); the survivors' allreduce
    # waits for peers that will never answer
    slots = {0: gen_slot("collective", 3, NOW - 5), 1: gen_slot("collective", 3, NOW - 5)}
    act = {0: idle(NOW - 5), 1: idle(NOW - 5)}
    verdict = find_hang(slots, NOW, CFG, act, generation=4, since=NOW - 1.5)
    assert verdict is not None and verdict.ranks == [0, 1] and "left" in verdict.how
    assert verdict.collateral  # another fault moved the generation: not theirs
    assert find_hang(slots, NOW, CFG, act, generation=4, since=NOW - 0.5) is None  # 0.5 s
    assert find_hang(slots, NOW, CFG, act, generation=3) is None  # the current one
    assert find_hang(slots, NOW, CFG, act) is None  # elastic: not judged this way
    # recovering (its collective failed) or computing in the old generation: not this
    slots = {0: gen_slot("recovering", 3, NOW - 5), 1: gen_slot("step", 3, NOW - 5)}
    assert find_hang(slots, NOW, CFG, act, generation=4, since=NOW - 2) is None
