"""`stalwart compare`'s figures and rendering, from fake step records (no runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.metrics.routes import (
    RouteRun,
    StepRecord,
    compare_document,
    faults_met,
    kept_losses,
    read_step_records,
    recoveries,
    route_figures,
)
from stalwart.metrics.routes_render import routes_html, routes_markdown


def _steps(
    pairs: list[tuple[int, float]], attempt: tuple[int, int] = (0, 0), loss: float = 1.0
) -> list[StepRecord]:
    return [StepRecord(s, attempt, t, loss) for s, t in pairs]


def _run(
    records: list[StepRecord], *, faults: tuple[float, ...] = (), rc: int = 0, **kw
) -> RouteRun:
    base = dict(route="flash", workers=4, spares=0, target=10, launched=0.0, exited=20.0)
    return RouteRun(**(base | kw), rc=rc, records=tuple(records), faults_at=faults)


def test_rto_is_fault_to_the_first_step_of_a_new_attempt_and_counts_redone_steps() -> None:
    before = _steps([(s, float(s)) for s in range(1, 7)])  # steps 1..6 at t=1..6
    after = _steps([(4, 9.0), (5, 9.5), (6, 10.0), (7, 10.5)], attempt=(0, 1))
    late = _steps([(7, 6.6)])  # a step in flight after the fault, same attempt: not it
    (rec,) = recoveries(tuple(before + late + after), (6.5,))
    assert rec.rto_s == pytest.approx(2.5)
    assert rec.steps_lost == 4  # 4..7 redone (7 was in flight at the fault)
    never = recoveries(tuple(before), (6.5,))
    assert never[0].rto_s is None and never[0].steps_lost is None


def test_figures_against_the_fault_free_run_of_the_same_route() -> None:
    free = _run(_steps([(s, 10.0 + s) for s in range(1, 11)], loss=2.0), exited=25.0)
    hit_records = _steps([(s, 10.0 + s) for s in range(1, 6)], loss=2.0) + _steps(
        [(s, 14.0 + s) for s in range(4, 11)], attempt=(0, 1), loss=2.5
    )
    hit = _run(hit_records, faults=(15.5,), exited=30.0, spares=1)
    row = route_figures(hit, free)
    assert row.reached and row.time_to_target_s == 30.0 and row.fault_free_s == 25.0
    # kept: 1..3 of the first attempt, 4..10 of the second; 1 and 4 follow no step of
    # their attempt (the median, 1 s): 10 s productive in 13 s + one step
    assert row.ettr == pytest.approx(10.0 / 14.0)
    assert row.utilisation == pytest.approx(10.0 / 14.0 * 4 / 5)  # the spare is held
    assert route_figures(free, free).ettr == pytest.approx(1.0)
    assert row.rto_p50_s == pytest.approx(2.5) and row.steps_lost == 2
    assert row.loss_gap == pytest.approx(0.5) and row.faults == row.recovered == 1


def test_a_survivor_stalled_in_its_attempt_is_not_productive_until_it_steps_normally() -> None:
    # torchft's survivors: member 0 keeps its attempt; the step after the fault waits 5 s
    # for the dead peer to be dropped, then steps go on at 1 s again
    recs = _steps([(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.1), (5, 9.0), (6, 10.0), (7, 11.0)])
    (rec,) = recoveries(tuple(recs), (4.0,))
    # 4 ended in flight after the fault (began before it); 5 stalled (9 - 4.1 > 2 x 1 s)
    assert rec.rto_s == pytest.approx(11.0 - 4.0 - 1.0)  # the end of 6: begun after, normal
    assert rec.steps_lost == 0
    free = _run(_steps([(s, float(s)) for s in range(1, 8)]), target=7)
    row = route_figures(_run(recs, faults=(4.0,), target=7), free)
    # 1 (unpaired), 4, 5 and 6 (ended inside the recovery, 4.0 .. 10.0) count the median
    # (1.0), 2, 3 and 7 their own second: 7 s productive over a 10 s span + one step
    assert row.ettr == pytest.approx(7.0 / 11.0)
    # async: a group that is not member 0's fails; member 0 never waits
    async_recs = _steps([(s, float(s)) for s in range(1, 8)])
    (quick,) = recoveries(tuple(async_recs), (3.5,))
    assert quick.rto_s == pytest.approx(5.0 - 3.5) and quick.steps_lost == 0


def test_utilisation_counts_every_member_so_a_group_down_while_others_go_on_is_idle() -> None:
    member0 = _steps([(s, float(s)) for s in range(1, 11)])
    member1 = _steps([(s, float(s)) for s in range(1, 4)]) + _steps(
        [(s, float(s)) for s in range(8, 11)], attempt=(1, 0)
    )  # down from 3 s to 8 s: steps 4..7 are not on its record
    base = dict(route="async", workers=2, spares=0, target=10, launched=0.0, exited=12.0)
    run = RouteRun(**base, rc=0, records=tuple(member0), faults_at=(3.5,),
                   member_records=(tuple(member0), tuple(member1)))  # fmt: skip
    row = route_figures(run, run)
    assert row.ettr == pytest.approx(1.0)  # member 0 never stopped
    # member 1: steps 1..3 and 8..10 (8 unpaired, the median): 6 s of 2 x (9 s span + 1)
    assert row.utilisation == pytest.approx((10.0 + 6.0) / 20.0)


def test_the_struck_rank_back_is_read_on_its_own_member_not_member_0() -> None:
    member0 = _steps([(s, float(s)) for s in range(1, 11)])  # never stopped (async)
    member1 = _steps([(s, float(s)) for s in range(1, 4)]) + _steps(
        [(s, float(s)) for s in range(8, 11)], attempt=(1, 0)
    )  # killed at 3.5 s, its group trains again at 8 s
    base = dict(route="async", workers=2, spares=0, target=10, launched=0.0, exited=12.0)
    run = RouteRun(**base, rc=0, records=tuple(member0), faults_at=(3.5,), fault_ranks=(1,),
                   member_records=(tuple(member0), tuple(member1)))  # fmt: skip
    row = route_figures(run, run)
    assert row.struck_back_p50_s == pytest.approx(8.0 - 3.5)
    assert row.rto_p50_s == pytest.approx(5.0 - 3.5)  # member 0 went on at once
    lost = RouteRun(**base, rc=0, records=tuple(member0), faults_at=(3.5,), fault_ranks=(1,),
                    member_records=(tuple(member0), tuple(member1[:3])))  # fmt: skip
    assert route_figures(lost, lost).struck_back_p50_s is None  # no new attempt on it
    # an async group restarted keeps its attempt: its new process tells
    respawned = member1[:3] + [StepRecord(s, (0, 0), float(s), 1.0, pid=7) for s in (8, 9, 10)]
    same = RouteRun(**base, rc=0, records=tuple(member0), faults_at=(3.5,), fault_ranks=(1,),
                    member_records=(tuple(member0), tuple(respawned)))  # fmt: skip
    assert route_figures(same, same).struck_back_p50_s == pytest.approx(8.0 - 3.5)


def test_a_route_that_misses_the_target_has_no_time_and_says_why() -> None:
    free = _run(_steps([(s, float(s)) for s in range(1, 11)]))
    hit = _run(_steps([(s, float(s)) for s in range(1, 6)]), faults=(5.5,), rc=-9)
    row = route_figures(hit, free)
    assert not row.reached and row.time_to_target_s is None and row.ettr is None
    assert "did not reach step 10 (stopped at the cap)" in row.note and row.recovered == 0


def test_kept_losses_take_the_last_attempt_and_torn_lines_are_skipped(tmp_path: Path) -> None:
    lines = [
        {"step": 1, "attempt": [0, 0], "t": 1.0, "loss": 3.0},
        {"step": 2, "attempt": [0, 0], "t": 2.0, "loss": 2.9},
        {"step": 2, "attempt": [1, 0], "t": 5.0, "loss": 2.8},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"step": 3, "att'
    (tmp_path / "trace-m0.jsonl").write_text(text)
    recs = read_step_records(tmp_path / "trace-m0.jsonl")
    assert len(recs) == 3 and recs[2].attempt == (1, 0)
    assert kept_losses(recs) == [(1, 3.0), (2, 2.8)]
    assert read_step_records(tmp_path / "absent.jsonl") == ()


def test_markdown_and_html_show_every_route_and_the_absent_ones() -> None:
    free = _run(_steps([(s, float(s)) for s in range(1, 11)]))
    row = route_figures(free, free)
    job = {"script": "nanogpt.py", "workers": 4, "target": 10, "load": "3.0 2.0 1.0"}
    trace = {"spec": "kill every=20s", "seed": 0, "horizon_s": 60.0, "faults": []}
    curves = {"flash": kept_losses(free.records), "flash/fault-free": kept_losses(free.records)}
    doc = compare_document(job, trace, [row], curves, {"async": "not built on this main"})
    md = routes_markdown(doc)
    assert "| flash | 0/0 | 20.0 | 20.0 | 1.000 | 1.000 | - |" in md
    assert "| async | not built on this main |" in md and "load average 3.0" in md
    page = routes_html(doc)
    assert "data:image/svg+xml;base64," in page and "not built on this main" in page
    assert json.loads(json.dumps(doc))["routes"]["flash"]["ettr"] == 1.0


def test_a_run_whose_faults_were_due_after_its_end_is_not_a_faulted_run() -> None:
    """A fast machine: the job's steps ended 9 s after the first, the trace's only fault
    was due at 12 s. The row says the fault never fired and shows no fault figure (an
    ETTR of 1.0 would pass for a perfect recovery)."""
    free = _run(_steps([(s, 10.0 + s) for s in range(1, 11)]))
    outrun = _run(free.records, planned_at=(12.0,))
    row = route_figures(outrun, free)
    assert not row.met_faults and row.planned == 1 and row.faults == 0
    assert "the trace's fault never fired (the job ended first" in row.note
    assert "steps ran 9.0 s" in row.note and "due at 12.0 s" in row.note
    assert row.ettr is None and row.time_to_target_s is None and row.loss_gap is None
    assert row.reached and row.fault_free_s == 20.0  # what is not a fault figure stays
    doc = compare_document({"script": "s", "workers": 4, "target": 10}, {}, [row], {}, {})
    doc["trace"] = {"spec": "kill every=12s", "seed": 0, "horizon_s": 13.0, "faults": [{}]}
    assert "| flash | 0/0 (no fault fired) | - |" in routes_markdown(doc)
    # one fault met, the trace's later ones past the end: a faulted run, the rest counted
    hit = _steps([(s, 10.0 + s) for s in range(1, 6)]) + _steps(
        [(s, 14.0 + s) for s in range(4, 11)], attempt=(0, 1)
    )
    met = route_figures(_run(hit, faults=(15.5,), planned_at=(5.5, 40.0, 80.0)), free)
    assert met.met_faults and met.faults == 1 and met.ettr is not None
    assert "2 of the trace's 3 faults never fired: the job ended first" in met.note
    none = faults_met((12.0, 30.0), 0, 9.0)
    assert not none.met and "the trace's 2 faults never fired" in none.note
    assert "the first was due at 12.0 s" in none.note
