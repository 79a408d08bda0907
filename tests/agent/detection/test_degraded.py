"""Degraded-link detection, in-process: the windows' judgement (agent/detection/degraded.py) fed
with simulated board readings (steps, compute time per step, the phase), the agreement
of the nodes' verdicts, and the detector's events, line and eviction
(agent/detection/_degraded_watch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from stalwart.agent.detection._degraded_watch import LinkDetector
from stalwart.agent.detection.degraded import (
    DegradedAction,
    DegradedConfig,
    LinkWindow,
    LinkWindows,
    agreed,
)
from stalwart.contract.board import Slot
from stalwart.errors import ConfigError
from stalwart.metrics.events import EventLog, read_events

from .._fakes import FakeEvents

CFG = DegradedConfig()


@dataclass
class Job:
    """Two local ranks stepping in lockstep: each step computes ``compute_s`` then waits
    in a collective (phase ``wait``) for the rest of ``step_s``; read every ``dt``."""

    generation: int = 0
    t: float = 0.0
    steps: int = 2
    compute: float = 0.0
    pos: float = 0.0
    pids: tuple[int, int] = (100, 101)
    windows: list[LinkWindow] = field(default_factory=list)

    def slots(self, phase: str) -> dict[int, Slot]:
        return {
            r: Slot(pid, self.steps, phase, self.generation, self.t, self.t, 0.1, True,
                    False, self.compute, self.steps)
            for r, pid in enumerate(self.pids)
        }  # fmt: skip

    def run(
        self,
        seconds: float,
        step_s: float,
        compute_s: float,
        watch: LinkWindows,
        *,
        wait: str = "collective",
        dt: float = 0.02,
    ) -> list[LinkWindow]:
        out = []
        for _ in range(round(seconds / dt)):
            self.t += dt
            self.pos += dt
            while self.pos >= step_s:
                self.pos -= step_s
                self.steps += 1
                self.compute += compute_s
            phase = "step" if self.pos < compute_s else wait
            if (w := watch.observe(self.slots(phase), self.t)) is not None:
                out.append(w)
        self.windows += out
        return out


def _learned(cfg: DegradedConfig = CFG) -> tuple[Job, LinkWindows]:
    job, watch = Job(), LinkWindows(cfg)
    healthy = job.run(20, 0.06, 0.05, watch)
    assert healthy and not any(w.slow or w.link_like for w in healthy)
    return job, watch


def test_healthy_steps_are_learned_and_never_slow() -> None:
    _, watch = _learned()
    w = watch.observe(Job(t=100.0).slots("step"), 100.0)  # steps gone back: a new process
    assert w is None and not watch.run and watch.first is None


def test_steps_many_times_longer_with_compute_as_before_are_link_like() -> None:
    job, watch = _learned()
    slow = job.run(9, 0.8, 0.05, watch)
    assert slow[-1].link_like and slow[-1].ratio > CFG.ratio
    assert slow[-1].median_step_s == pytest.approx(0.06, rel=0.1)
    assert slow[-1].compute_s == pytest.approx(0.05, rel=0.1)
    assert slow[-1].wait_share > 0.8
    assert watch.persisting()


def test_compute_that_slows_with_the_step_is_not_the_link() -> None:
    job, watch = _learned()
    slow = job.run(12, 0.3, 0.28, watch)
    assert all(w.slow for w in slow[1:]) and not any(w.link_like for w in slow)
    assert not watch.persisting()


def test_a_small_compute_that_wobbles_does_not_hide_the_link() -> None:
    # 9 ms of compute seen at 27 ms (another process on the core) against a step gone
    # from 190 to 750 ms: the step's growth is waiting, whatever the compute's ratio
    job, watch = Job(), LinkWindows(CFG)
    job.run(20, 0.19, 0.009, watch)
    slow = job.run(9, 0.75, 0.027, watch)
    assert slow[-1].compute_s / slow[-1].median_compute_s > 2.5 and slow[-1].link_like


def test_reads_far_apart_add_nothing_to_the_wait_share() -> None:
    # the agent's loop held 2 s by a store call: what its ranks did meanwhile is unseen
    job, watch = Job(), LinkWindows(CFG)
    job.run(20, 0.1, 0.05, watch, dt=0.01)  # half of each step in a collective
    while not job.run(0.01, 0.1, 0.05, watch, dt=0.01):
        pass  # a window just closed: the next starts here
    job.run(1.0, 0.1, 0.05, watch, dt=0.01)
    job.t += 2.0  # one read 2 s later, seen in a collective: it closes the window
    w = watch.observe(job.slots("collective"), job.t)
    assert w is not None and w.wait_share == pytest.approx(0.5, abs=0.1)  # not (0.5 + 2) / 3


def test_ranks_that_do_not_wait_in_a_collective_are_not_the_link() -> None:
    # an eval or a sess.pause between steps: the time went elsewhere
    job, watch = _learned()
    slow = job.run(12, 0.8, 0.05, watch, wait="paused")
    assert any(w.slow for w in slow) and not any(w.link_like for w in slow)


def test_a_link_that_passes_nothing_is_a_partition_not_a_degraded_link() -> None:
    job, watch = _learned()
    stalled = job.run(12, 1000.0, 0.05, watch)  # not one step completes
    assert all(w.steps == 0 for w in stalled[1:]) and stalled[-1].link_like
    assert not watch.persisting()  # the data plane watch's fault, not this one's


def test_a_link_back_to_its_pace_is_recovered() -> None:
    job, watch = _learned()
    job.run(9, 0.8, 0.05, watch)
    assert watch.persisting()
    back = job.run(6, 0.06, 0.05, watch)
    assert watch.recovered(back[-1]) and not watch.persisting()


def test_a_new_generation_starts_the_windows_afresh() -> None:
    job, watch = _learned()
    job.run(9, 0.8, 0.05, watch)
    assert watch.persisting()
    job.generation = 1
    job.run(0.1, 0.8, 0.05, watch)
    assert not watch.run and watch.first is None and not watch.persisting()


def test_nothing_is_judged_before_the_medians_are_learned() -> None:
    job, watch = Job(), LinkWindows(CFG)
    out = job.run(12, 0.8, 0.05, watch)
    assert out and not any(w.slow for w in out[: CFG.learn])


def test_no_other_node_may_say_otherwise_freshly_in_the_same_generation() -> None:
    fresh = {"t": 100.0, "span": 3.0, "generation": 2, "link": True, "ratio": 9.0}
    assert agreed({1: fresh, 2: fresh}, 2, 101.0, 3.0)
    assert not agreed({1: fresh, 2: {**fresh, "link": False}}, 2, 101.0, 3.0)
    assert not agreed({1: fresh}, 3, 101.0, 3.0)  # another generation: a recovery
    assert not agreed({1: {**fresh, "span": 10.0, "link": False}}, 2, 120.0, 3.0)  # long windows
    assert not agreed({1: {**fresh, "link": 1}}, 2, 101.0, 3.0)
    # no counter-evidence: stale (its agent sits in store calls over the lossy link),
    # never published, unreadable
    assert agreed({1: {**fresh, "link": False}}, 2, 120.0, 3.0)
    assert agreed({1: None}, 2, 101.0, 3.0)
    assert agreed({1: {**fresh, "t": "soon", "link": False}}, 2, 101.0, 3.0)


def test_bad_settings_are_refused_with_the_flag_named() -> None:
    with pytest.raises(ConfigError, match="--on-degraded 'kick'"):
        DegradedAction.parse("kick")
    assert DegradedAction.parse("evict") is DegradedAction.EVICT
    with pytest.raises(ConfigError, match="ratio"):
        DegradedConfig(ratio=1.2, recover_ratio=1.5)
    with pytest.raises(ConfigError, match="compute_share"):
        DegradedConfig(compute_share=1.0)
    with pytest.raises(ConfigError, match="wait_share"):
        DegradedConfig(wait_share=0.0)
    with pytest.raises(ConfigError, match="window"):
        DegradedConfig(window_s=0.0)
    with pytest.raises(ConfigError, match="learn"):
        DegradedConfig(learn=50, history=20)


class _Workers:
    def __init__(self, job: Job) -> None:
        self.job, self.phase = job, "step"

    def judged(self) -> dict[int, Slot]:
        return self.job.slots(self.phase)


@dataclass
class _Records:
    store: dict[str, dict[str, Any]] = field(default_factory=dict)

    def publish(self, key: str, record: dict[str, Any]) -> None:
        self.store[key] = record

    def published(self, key: str) -> dict[str, Any] | None:
        return self.store.get(key)


def _detector(
    node: int, action: DegradedAction, records: _Records, evicted: list[tuple[int, str]]
) -> tuple[LinkDetector, FakeEvents, list[str], Job]:
    job, events, lines = Job(), FakeEvents(), []
    detector = LinkDetector(
        config=DegradedConfig(action=action),
        node=node,
        workers=_Workers(job),  # type: ignore[arg-type]  # judged() is all it reads
        records=records,
        live=lambda: {0, 1},
        holder=lambda live: 0,
        evict=lambda far, how, t0: evicted.append((far, how)),
        events=events,
        say=lines.append,
    )
    return detector, events, lines, job


def _drive(pairs: list[tuple[LinkDetector, Job]], seconds: float, step_s: float) -> None:
    """The nodes' agents in lockstep, each reading its own board every 20 ms."""
    dt = 0.02
    for _ in range(round(seconds / dt)):
        for detector, job in pairs:
            workers = detector._workers
            assert isinstance(workers, _Workers)
            job.t += dt
            job.pos += dt
            while job.pos >= step_s:
                job.pos -= step_s
                job.steps += 1
                job.compute += 0.05
            workers.phase = "step" if job.pos < 0.05 else "collective"
            detector.check(job.t)


def test_the_detector_declares_when_both_nodes_agree_and_says_when_it_recovers(
    tmp_path: Path,
) -> None:
    records, evicted = _Records(), []
    d0, events, lines, job0 = _detector(0, DegradedAction.REPORT, records, evicted)
    d1, events1, _, job1 = _detector(1, DegradedAction.REPORT, records, evicted)
    for step_s, seconds in ((0.06, 20), (0.8, 12)):
        _drive([(d0, job0), (d1, job1)], seconds, step_s)
    assert "link_degraded" in events.kinds() and "link_degraded" in events1.kinds()
    rec = events.of("link_degraded")[0]
    assert rec["domain"] == {"rank": None, "node": 0} and rec["peers"] == [1]
    assert rec["ratio"] > 3 and rec["action"] == "report" and evicted == []
    assert any("link between node 0 and node 1 is degraded" in line for line in lines)
    _drive([(d0, job0), (d1, job1)], 6, 0.06)
    assert events.kinds()[-1] == "link_recovered"
    assert "recovered" in lines[-1]
    log = EventLog(str(tmp_path / "events.jsonl"))  # the records pass the schema
    for kind, fields in events.records:
        log.emit(kind, **fields)
    log.close()
    assert [e.kind for e in read_events(str(tmp_path / "events.jsonl")).events] == events.kinds()


def test_a_node_alone_in_its_slowness_declares_nothing() -> None:
    records, evicted = _Records(), []
    d0, events, _, job0 = _detector(0, DegradedAction.REPORT, records, evicted)
    d1, _, _, job1 = _detector(1, DegradedAction.REPORT, records, evicted)
    _drive([(d0, job0), (d1, job1)], 20, 0.06)
    for _ in range(12):  # node 1 publishes only healthy windows
        _drive([(d0, job0)], 1, 0.8)
        _drive([(d1, job1)], 1, 0.06)
    assert "link_degraded" not in events.kinds()


def test_evict_on_the_node_holding_rank_0_revokes_the_far_node_only_there() -> None:
    records, evicted = _Records(), []
    d0, events, _, job0 = _detector(0, DegradedAction.EVICT, records, evicted)
    d1, events1, lines1, job1 = _detector(1, DegradedAction.EVICT, records, evicted)
    for step_s, seconds in ((0.06, 20), (0.8, 12)):
        _drive([(d0, job0), (d1, job1)], seconds, step_s)
    assert [far for far, _ in evicted] == [1]
    assert events.of("link_degraded")[0]["action"] == "evict"
    assert events1.of("link_degraded")[0]["action"] == "report"
    assert any("node 0 (holding rank 0) decides" in line for line in lines1)
