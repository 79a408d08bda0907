"""`stalwart compare` in-process: routes, launcher commands, torchrun's injected signals."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from _load import scaled

from stalwart.chaos.trace import TraceFault, compile_trace
from stalwart.cli._compare_run import Route, RunSettings, _command, _Injector, load_route
from stalwart.cli.compare import _routes
from stalwart.cli.main import build_parser, main
from stalwart.metrics.routes import RouteRun, route_figures


def _settings(tmp_path: Path) -> RunSettings:
    return RunSettings(tmp_path / "train.py", ("--max_iters", "50"), 4, 50, tmp_path, 60.0, 10)


def test_every_route_is_a_column_or_one_line_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("stalwart.cli.compare.lighthouse_binary", lambda: None)
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["compare", "--target", "5", "--routes", "flash,bogus", str(script)]) == 2
    assert "unknown bogus" in capsys.readouterr().err
    assert main(["compare", "--target", "5", str(tmp_path / "absent.py")]) == 2
    assert "not found" in capsys.readouterr().err
    argv = ["compare", "--target", "5", "--routes", "torchft", "--out", str(tmp_path)]
    assert main([*argv, str(script)]) == 0
    doc = json.loads((tmp_path / "routes.json").read_text())
    assert doc["routes"] == {} and "torchft" in doc["absent"]["torchft"]
    assert "| torchft | torchft is not installed" in (tmp_path / "routes.md").read_text()


def test_async_is_a_column_with_its_groups_now_that_the_strategy_exists() -> None:
    args = build_parser().parse_args(["compare", "--target", "5", "x.py"])
    routes, absent = _routes(args)
    (route,) = [r for r in routes if r.name == "async"]
    assert route.launcher_args == ("--replica-groups", "2", "--sync-every", "20")
    assert "async" not in absent


def test_torchft_is_a_column_run_by_its_own_launcher_when_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("stalwart.cli.compare.lighthouse_binary", lambda: "/bin/lighthouse")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    args = build_parser().parse_args(["compare", "--target", "5", "x.py"])
    routes, absent = _routes(args)
    (route,) = [r for r in routes if r.name == "torchft"]
    assert "torchft" not in absent and route.injected and route.extra_args == ("--torchft",)
    cmd = _command(route, _settings(tmp_path), tmp_path, "j", "kill rank=1 at=time:5s")
    assert cmd[1:3] == ["-m", "stalwart.cli._torchft_launch"] and "--chaos" not in cmd
    assert cmd[cmd.index("--workers") + 1] == "4" and cmd[-3:-1] == ["--torchft", "--out"]


def test_commands_carry_the_trace_the_same_way_to_every_stalwart_route(tmp_path: Path) -> None:
    st = _settings(tmp_path)
    trace = compile_trace("kill every=10s jitter=0 rank=1", seed=0, ranks=4, horizon_s=25)
    spec = trace.chaos_spec()
    assert spec == "kill rank=1 at=time:10.000s; kill rank=1 at=time:20.000s"
    restart = _command(Route("restart", "stalwart", "restart"), st, tmp_path, "j", spec)
    assert restart[restart.index("--chaos") + 1] == spec
    assert restart[restart.index("--persist-every") + 1] == "10"
    assert restart[restart.index("--blocklist-after") + 1] == "1000"
    spare = _command(Route("spare", "stalwart", "spare", spares=1), st, tmp_path, "j", "")
    assert "--chaos" not in spare and spare[spare.index("--spares") + 1] == "1"
    tr = _command(Route("torchrun", "torchrun", extra_args=("--plain",)), st, tmp_path, "j", spec)
    assert tr[0].endswith("torchrun") and "--chaos" not in tr and "--plain" in tr
    assert tr[tr.index("--max-restarts") + 1] == "1000"


def _record(path: Path, pid: int, t: float, step: int = 1) -> None:
    rec = {"step": step, "attempt": [0, 0], "t": t, "pid": pid, "loss": 1.0}
    path.write_text(json.dumps(rec) + "\n")


@pytest.mark.timeout(60)
def test_torchruns_signal_strikes_the_ranks_process_at_the_instant(tmp_path: Path) -> None:
    launcher = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
    assert launcher.stdout is not None
    worker = int(launcher.stdout.readline())
    try:
        t0 = time.time()
        _record(tmp_path / "trace-m0.jsonl", os.getpid(), t0)  # not below the launcher
        _record(tmp_path / "trace-m1.jsonl", worker, t0)
        inj = _Injector(tmp_path, launcher.pid, (TraceFault(0.3, "kill", 1),), 50)
        inj.start()
        inj.join(timeout=30)
        assert not inj.is_alive() and len(inj.fired) == 1 and inj.fired[0] >= t0 + 0.3
        # its child was killed: `wait` returned
        assert launcher.wait(timeout=scaled(30)) is not None
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.timeout(60)
def test_a_process_compare_did_not_start_is_never_signalled(tmp_path: Path) -> None:
    launcher = subprocess.Popen(["sleep", "60"])
    try:
        _record(tmp_path / "trace-m0.jsonl", os.getpid(), time.time())
        inj = _Injector(tmp_path, launcher.pid, (TraceFault(0.1, "kill", 0),), 50)
        inj.start()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not inj.fired:
            time.sleep(0.05)
        inj.stop.set()
        inj.join(timeout=10)
        assert inj.fired == []  # it waited for a process of the job's: pytest was never one
    finally:
        launcher.kill()
        launcher.wait()


def _leave_run(
    folder: Path, steps: list[tuple[int, float]], faults: list[float], rc: int = 0
) -> None:
    corpus = folder / "corpus"
    corpus.mkdir(parents=True)
    lines = [{"step": s, "attempt": [0, 0], "t": t, "pid": 1, "loss": 1.0} for s, t in steps]
    (corpus / "trace-m0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    obs = {"launched": steps[0][1] - 5.0, "exited": steps[-1][1] + 1.0, "rc": rc}
    (folder / "observed.json").write_text(json.dumps(obs | {"faults_at": faults}))


def test_reuse_makes_the_table_from_the_runs_in_out_without_running_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    out = tmp_path / "cmp"
    t = 1_800_000_000.0
    _leave_run(out / "flash-fault-free", [(s, t + s) for s in range(1, 11)], [])
    stall = [(s, t + s) for s in range(1, 5)] + [(s, t + s + 3.0) for s in range(5, 11)]
    _leave_run(out / "flash-faulted", stall, [t + 4.2])

    def never(*_: object) -> None:
        raise AssertionError("--reuse ran a route whose runs were in OUT")

    monkeypatch.setattr("stalwart.cli.compare.run_route", never)
    monkeypatch.setattr("stalwart.cli.compare.simulate_route", lambda out: {"note": "-"})
    argv = ["compare", "--reuse", "--routes", "flash", "--target", "10", "--out", str(out)]
    assert main([*argv, "--trace", "kill every=30s", str(script)]) == 0
    row = json.loads((out / "routes.json").read_text())["routes"]["flash"]
    assert row["reached"] and row["recovered"] == 1 and row["ettr"] < 1.0
    # the runs are of the trace recorded in OUT: another trace is refused, not mixed in
    assert main([*argv, "--trace", "kill every=7s", str(script)]) == 2


def test_a_kill_at_the_last_step_is_unfired_and_the_run_still_finished(tmp_path: Path) -> None:
    """The trace's third kill fired once member 0 had recorded the target step: it struck a
    rank on its way out and the launcher exited 1 (a rank failed after a peer finished).
    The run reached its target with the two faults it met; the third counts unfired."""
    t = 1_800_000_000.0
    steps = [(s, t + s) for s in range(1, 4)] + [(s, t + s + 2.0) for s in range(3, 11)]
    _leave_run(tmp_path / "flash-faulted", steps, [t + 3.5, t + 7.2, t + 12.0], rc=1)
    trace = compile_trace("kill every=4s", seed=0, ranks=4, horizon_s=13.0)
    st = RunSettings(tmp_path / "train.py", (), 4, 10, tmp_path, 60.0, 10)
    run = load_route(Route("flash", "stalwart", "flash"), st, trace, "flash/faulted")
    assert run is not None and run.reached and run.rc == 1
    assert run.faults_at == (t + 3.5, t + 7.2) and run.late_faults == 1
    assert len(run.fault_ranks) == 2
    free = RouteRun(**{**run.__dict__, "rc": 0, "faults_at": (), "late_faults": 0})
    row = route_figures(run, free)
    assert row.reached and row.time_to_target_s is not None and row.faults == 2
    assert "1 fault(s) fired after step 10 was recorded" in row.note
    # a failure with no late fault to explain it is still a run that did not finish
    _leave_run(tmp_path / "restart-faulted", steps, [t + 3.5], rc=1)
    failed = load_route(Route("restart", "stalwart", "restart"), st, trace, "restart/faulted")
    assert failed is not None and not failed.reached and failed.late_faults == 0


@pytest.mark.timeout(60)
def test_torchruns_injector_sends_nothing_once_the_target_step_is_recorded(
    tmp_path: Path,
) -> None:
    launcher = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
    assert launcher.stdout is not None
    worker = int(launcher.stdout.readline())
    try:
        t0 = time.time()
        _record(tmp_path / "trace-m0.jsonl", os.getpid(), t0, step=50)  # the last step
        _record(tmp_path / "trace-m1.jsonl", worker, t0)
        inj = _Injector(tmp_path, launcher.pid, (TraceFault(0.1, "kill", 1),), 50)
        inj.start()
        inj.join(timeout=30)
        assert not inj.is_alive() and inj.fired == []
        assert launcher.poll() is None  # the worker was not killed
    finally:
        launcher.kill()
        launcher.wait()


def test_torchft_is_replayed_as_a_pause_per_fault_that_rolls_nothing_back() -> None:
    from stalwart.cli._compare_sim import simulate_injected
    from stalwart.metrics.routes import RouteRun, StepRecord

    def run(stall_at: tuple[float, ...]) -> RouteRun:
        recs, t = [], 100.0
        for s in range(1, 201):
            t += 0.1 + (5.0 if any(t < f <= t + 0.1 for f in stall_at) else 0.0)
            recs.append(StepRecord(s, (0, 0), t, 1.0))
        base = dict(route="torchft", workers=4, spares=0, target=200, rc=0)
        return RouteRun(**base, launched=95.0, exited=t + 1.0, records=tuple(recs),
                        faults_at=stall_at)  # fmt: skip

    hit, free = run((105.0, 112.0)), run(())
    sim = simulate_injected(hit, free, "torchft", 25)
    assert "note" not in sim, sim
    # ~20 s fault-free span + 6 s start and end, 2 stalls of 5 s: measured = predicted
    assert sim["measured_ettr"] == pytest.approx(19.9 / 36.0, abs=0.01)
    assert sim["predicted_ettr"] == pytest.approx(sim["measured_ettr"], abs=0.05)


def test_the_torchft_route_runs_the_script_under_the_lighthouse_launcher(tmp_path: Path) -> None:
    st = _settings(tmp_path)
    ft = _command(Route("torchft", "torchft", extra_args=("--torchft",)), st, tmp_path, "j", "")
    assert ft[1:3] == ["-m", "stalwart.cli._torchft_launch"]
    assert ft[ft.index("--workers") + 1] == "4" and "--chaos" not in ft
    assert ft[ft.index("--") + 1] == str(st.script) and "--torchft" in ft


@pytest.mark.parametrize(
    "observed",
    [
        None,  # compare was stopped before it wrote the run down
        "{not json",
        json.dumps({"launched": 5.0, "exited": 9.0}),  # no rc, no faults_at
        json.dumps({"launched": 9.0, "exited": 5.0, "rc": 0, "faults_at": []}),  # ended first
        json.dumps({"launched": 0, "exited": 5.0, "rc": 0, "faults_at": []}),  # never launched
    ],
)
def test_reuse_skips_a_run_it_cannot_read_back(tmp_path: Path, observed: str | None) -> None:
    """``--reuse`` reads what an earlier compare left: a run whose record is missing,
    torn or inconsistent is no run (it is run again), never a row of made-up figures."""
    folder = tmp_path / "flash-faulted"
    folder.mkdir()
    if observed is not None:
        (folder / "observed.json").write_text(observed)
    st = RunSettings(tmp_path / "train.py", (), 4, 10, tmp_path, 60.0, 10)
    assert load_route(Route("flash", "stalwart", "flash"), st, None, "flash/faulted") is None
