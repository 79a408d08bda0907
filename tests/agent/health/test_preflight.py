"""The preflight's verdicts (agent/health/preflight.py): DLRover's slow node vs slow link,
in-process with fake timings and a fake launch record."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from stalwart.agent.health.preflight import (
    PreflightConfig,
    Timing,
    classify,
    decide,
    pair_up,
    retest_rounds,
    run_preflight,
)

NODES = [0, 1, 2, 3]


def _r1(
    mm: dict[int, float] | None = None, ar: dict[int, float] | None = None
) -> dict[int, Timing]:
    mm, ar = mm or {}, ar or {}
    partner = {0: 1, 1: 0, 2: 3, 3: 2}
    return {n: Timing(n, partner[n], mm.get(n, 0.01), ar.get(n, 0.02)) for n in NODES}


def test_pairs_and_retests() -> None:
    assert pair_up([0, 1, 2, 3, 4]) == [(0, 1), (2, 3)]
    assert retest_rounds([2, 3], [0, 1]) == [[(0, 2), (1, 3)]]
    assert retest_rounds([2, 3, 4], [0]) == [[(0, 2)], [(0, 3)], [(0, 4)]]
    assert retest_rounds([1], []) == []


def test_healthy_nodes_are_all_ok_without_a_second_round() -> None:
    r1 = _r1()
    unfit, suspects, fast = classify(NODES, r1, 3.0)
    assert unfit == {} and suspects == [] and fast == NODES
    assert all(v.ok and v.verdict == "ok" for v in decide(NODES, r1, {}, 3.0).values())


def test_slow_compute_is_blocklisted_from_round_one() -> None:
    r1 = _r1(mm={2: 0.2})
    verdicts = decide(NODES, r1, {}, 3.0)
    assert not verdicts[2].ok and verdicts[2].verdict == "slow compute"
    assert "20.0x" in verdicts[2].detail


def test_slow_node_is_told_from_its_partner_by_the_second_round() -> None:
    r1 = _r1(ar={2: 0.5, 3: 0.5})  # pair 2-3 slow: which one?
    _, suspects, fast = classify(NODES, r1, 3.0)
    assert suspects == [2, 3] and fast == [0, 1]
    rounds = retest_rounds(suspects, fast)
    assert rounds == [[(0, 2), (1, 3)]]
    r2 = {2: Timing(2, 0, 0.01, 0.6), 3: Timing(3, 1, 0.01, 0.02)}  # 2 slow again
    verdicts = decide(NODES, r1, r2, 3.0)
    assert not verdicts[2].ok and verdicts[2].verdict == "slow node"
    assert "slow with every partner" in verdicts[2].detail
    assert verdicts[3].ok and verdicts[3].verdict == "ok"
    assert verdicts[0].ok and verdicts[1].ok


def test_both_fast_again_is_a_slow_link_reported_not_blocklisted() -> None:
    r1 = _r1(ar={2: 0.5, 3: 0.5})
    r2 = {2: Timing(2, 0, 0.01, 0.02), 3: Timing(3, 1, 0.01, 0.02)}
    verdicts = decide(NODES, r1, r2, 3.0)
    assert verdicts[2].ok and verdicts[2].verdict == "slow link"
    assert "between nodes 2 and 3" in verdicts[3].detail


def test_a_failed_check_is_unfit_and_its_partner_is_retested() -> None:
    r1 = _r1()
    r1[1] = Timing(1, 0, math.inf, math.inf, "partner never came")
    unfit, suspects, fast = classify(NODES, r1, 3.0)
    assert set(unfit) == {1} and suspects == [0] and fast == [2, 3]


def test_malformed_records_are_failures() -> None:
    assert Timing.from_json({"node": "x"}).error.startswith("malformed")
    bad = Timing.from_json(
        {"node": 1, "partner": 0, "matmul_s": -1.0, "allreduce_s": 0.1, "error": ""}
    )
    assert "implausible" in bad.error


class _Launch:
    def __init__(self) -> None:
        self.kv: dict[str, dict[str, Any]] = {}
        self.cond = threading.Condition()

    def publish(self, key: str, record: dict[str, Any]) -> None:
        with self.cond:
            self.kv[key] = record
            self.cond.notify_all()

    def read(self, key: str, timeout: float) -> dict[str, Any]:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.kv, timeout), key
            return self.kv[key]


def test_every_node_reaches_the_same_verdict_through_the_launch_record() -> None:
    launch = _Launch()
    slow = 2

    def check_for(node: int) -> Any:
        def check(addr: str, rank: int, partner: int) -> Timing:
            assert addr.startswith("127.0.0.1:")
            ar = 0.5 if slow in (node, partner) else 0.02
            return Timing(node, partner, 0.01, ar)

        return check

    results: dict[int, Any] = {}
    cfg = PreflightConfig(timeout_s=10)

    def one(n: int) -> None:
        results[n] = run_preflight(NODES, n, launch, check_for(n), host="127.0.0.1", cfg=cfg)

    threads = [threading.Thread(target=one, args=(n,)) for n in NODES]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert time.monotonic() - t0 < 30 and len(results) == 4
    verdicts = {n: {k: v.verdict for k, v in r[0].items()} for n, r in results.items()}
    assert all(v == verdicts[0] for v in verdicts.values())
    assert verdicts[0] == {0: "ok", 1: "ok", 2: "slow node", 3: "ok"}
    assert "preflight-r2.0-pair0" in launch.kv  # node 2 was paired again with node 0


def test_a_single_node_checks_itself_with_two_processes() -> None:
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def check(addr: str, rank: int, partner: int) -> Timing:
        with lock:
            seen.append((rank, partner))
        return Timing(0, partner, 0.01, 0.02)

    verdicts, _ = run_preflight([0], 0, _Launch(), check, host="127.0.0.1", cfg=PreflightConfig())
    assert sorted(seen) == [(0, 0), (1, 0)]
    assert verdicts[0].ok and "single node" in verdicts[0].detail

    def broken(addr: str, rank: int, partner: int) -> Timing:
        return Timing(0, partner, math.inf, math.inf, "gloo failed" if rank else "")

    verdicts, _ = run_preflight([0], 0, _Launch(), broken, host="127.0.0.1", cfg=PreflightConfig())
    assert not verdicts[0].ok and verdicts[0].detail == "gloo failed"
