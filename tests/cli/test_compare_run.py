"""`stalwart compare` for real: two routes (torchrun and flash), one kill, a small job.

What it shows: the same recorded instant strikes both routes (torchrun's by compare's own
signal, flash's by stalwart's chaos), both reach the target, and the table, the JSON and
the page are written with a recovery per route. No timing threshold: only that each route
recovered its one fault and flash lost no quality against its fault-free run.

The trace's instant is in seconds after the first step and the job is sized in steps: on
a fast machine 300 steps outran a 3 s fault (issue 35). Each job therefore has a floor on
its length that no machine speed lowers: rank 0 evaluates every ``--eval_interval`` steps
for ``--eval_pause`` seconds (a fixed batch, no RNG drawn), so its steps span at least
(steps / interval) x pause seconds, several times the fault's instant; a slower machine only
makes the span longer. Should a fault still not fire, the test fails saying so (compare's
row: "the fault never fired", and the run's own ``fault_unfired`` event), not with a count.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from stalwart.chaos import unmet_faults
from stalwart.cli.main import main
from stalwart.metrics.events import read_events

_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "corpus" / "nanogpt.py"


def _met(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """The route's row, or the test fails with why its fault never fired."""
    row: dict[str, Any] = doc["routes"][name]
    if not row["met_faults"]:
        pytest.fail(f"{name}: {row['note']}")
    return row


def _met_in_events(run_dir: Path) -> None:
    """Every fault planned on a `stalwart run` fired, or the test fails naming it and why."""
    res = read_events(str(run_dir / "events.jsonl"))
    unmet = unmet_faults((e.kind, e.fields) for e in res.events)
    if unmet:
        pytest.fail("; ".join(unmet))


@pytest.mark.e2e  # compare runs jobs (tests/_tiers.py)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_routes_one_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", "--routes", "torchrun,flash", "--nproc-per-node", "2", "--target", "90"]
    argv += ["--trace", "kill every=2s jitter=0 rank=1", "--horizon", "2.5", "--out", str(out)]
    # a faulted run is stopped at --cap x its fault-free run's time: 10, not 3, as torchrun's
    # restart imports torch again, which the load of a shared machine can make several
    # times longer than it was in the fault-free run a minute before
    argv += ["--timeout", "400", "--cap", "10"]
    argv += [str(_SCRIPT), "--max_iters", "90", "--eval_interval", "3"]
    # 30 evals: its steps span 9 s or more, the fault is at 2 (90 steps, not 300: the steps
    # between the evals add nothing that is judged, and they were most of the test's time)
    argv += ["--eval_pause", "0.3"]
    assert main(argv) == 0
    doc = json.loads((out / "routes.json").read_text())
    assert set(doc["routes"]) == {"torchrun", "flash"}
    _met_in_events(out / "flash-faulted" / "run")  # first: a fault that never fired says so
    assert [f["t_s"] for f in doc["trace"]["faults"]] == [2.0]
    for name in doc["routes"]:
        row = _met(doc, name)
        assert row["reached"], (name, row["note"])
        assert (row["faults"], row["recovered"]) == (1, 1), name
        assert row["rto_p50_s"] > 0 and row["ettr"] > 0
    assert doc["routes"]["flash"]["loss_gap"] == 0.0  # bit-identical recovery, same losses
    assert "| torchrun | 1/1 |" in (out / "routes.md").read_text()
    assert "data:image/svg+xml" in (out / "routes.html").read_text()
    said = capsys.readouterr().out
    assert "flash/faulted: fault 1 at" in said and "torchrun/faulted: fault 1 at" in said
    # this test's jobs only (each route's run has a job id of its own, cmp-<random>): a
    # session running beside this one leaves names of its own jobs there meanwhile
    jobs = [json.loads(p.read_text())["job"] for p in out.glob("*/run/run.json")]
    assert jobs and all(job.startswith("cmp-") for job in jobs)
    assert not [p for job in jobs for p in glob.glob(f"/dev/shm/stalwart-{job}-*")]


@pytest.mark.e2e  # compare runs jobs (tests/_tiers.py)
@pytest.mark.matrix  # the routes' matrix: make test-matrix (README, "Developing")
@pytest.mark.timeout(600)
def test_torchft_route_heals_the_killed_group_from_a_live_one(tmp_path: Path) -> None:
    if importlib.util.find_spec("torchft") is None:
        why = "the torchft route needs torchft: pip install '.[bench]' (make setup does)"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI installs it: a missing torchft is a broken set-up there
        pytest.skip(why)
    out = tmp_path / "cmp"
    argv = ["compare", "--routes", "torchft", "--nproc-per-node", "2", "--target", "300"]
    argv += ["--trace", "kill every=3s jitter=0 rank=1", "--horizon", "3.5", "--out", str(out)]
    argv += ["--timeout", "400", str(_SCRIPT), "--max_iters", "300", "--eval_interval", "10"]
    # 30 evals of 1 s: rank 0's steps span 30 s or more, the kill is at 3 s, and group 0 is
    # still training when group 1's torchrun has restarted it (a new Python, torch and
    # torchft imported: seconds on a quiet machine, tens of seconds under load), to heal
    # from group 0; each pause stays under the 5 s timeout of the groups' allreduce (group
    # 1 waits in it)
    argv += ["--eval_pause", "1"]
    assert main(argv) == 0
    row = _met(json.loads((out / "routes.json").read_text()), "torchft")
    assert row["reached"] and (row["faults"], row["recovered"]) == (1, 1), row["note"]
    corpus = out / "torchft-faulted" / "corpus"
    member1 = [json.loads(x) for x in (corpus / "trace-m1.jsonl").read_text().splitlines()]
    assert {tuple(r["attempt"]) for r in member1} == {(0, 0), (1, 0)}  # restarted once
    restarted = [r for r in member1 if r["attempt"] == [1, 0]]
    member0 = [json.loads(x) for x in (corpus / "trace-m0.jsonl").read_text().splitlines()]
    if restarted[0]["t"] > member0[-1]["t"]:  # not a heal to judge: say why, not "1 > 1"
        pytest.fail(
            f"group 0 ended its steps {restarted[0]['t'] - member0[-1]['t']:.1f} s before the "
            "killed group 1 stepped again: no live group was left to heal from (the job is "
            "shorter than a restart on this machine now)"
        )
    assert restarted[0]["step"] > 1  # healed from the live group, not begun again at step 1
    finals = [json.loads((corpus / f"final-m{m}.json").read_text()) for m in (0, 1)]
    assert finals[0]["digest"] == finals[1]["digest"]  # one quorum: the same parameters
