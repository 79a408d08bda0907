"""A reused --run-dir: the previous run's records rotated into prev/<N>, checkpoints kept."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stalwart.agent.rundir._claim import MARKER, claim_run_dir
from stalwart.errors import ConfigError

from .._launch import events_of, stalwart_run

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_lm.py"
ARGS = ["--dim", "32", "--layers", "1", "--seq", "16", "--batch", "4"]


def _previous_run(run: Path) -> None:
    """What a finished run leaves: its records, a checkpoint, the token, a user's file."""
    (run / "chaos").mkdir(parents=True)
    (run / "chaos" / "fired-0.json").write_text("{}")
    (run / "logs").mkdir()
    (run / "logs" / "rank0.log").write_text("old log\n")
    (run / "events.jsonl").write_text('{"old": 1}\n')
    (run / "agent.json").write_text("{}")
    (run / "ckpt" / "step_000000000004").mkdir(parents=True)
    (run / "ckpt" / "step_000000000004" / "manifest.json").write_text("{}")
    (run / "token").write_text("t")
    (run / "report.html").write_text("mine")


def _marker(run: Path, job: str, agents: list[list[object]]) -> None:
    doc = {"v": 2, "job": job, "agents": agents, "t": 0.0}
    (run / MARKER).write_text(json.dumps(doc))


def _start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


def _agent_elsewhere(run: Path, job: str) -> subprocess.Popen[str]:
    """Another process claiming ``run`` for ``job`` and living on, as an agent of another
    node does (on this host or another: its liveness is its lock, not its pid)."""
    code = (
        "import sys, time; from stalwart.agent.rundir._claim import claim_run_dir; "
        f"claim_run_dir({str(run)!r}, {job!r}); print('ready', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_fresh_directory_moves_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert claim_run_dir(str(run), "j") is None
    doc = json.loads((run / MARKER).read_text())
    me = [os.getpid(), _start_time(os.getpid()), socket.gethostname()]
    assert doc["job"] == "j" and doc["agents"] == [me]


def test_previous_run_is_rotated_and_checkpoints_stay(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _previous_run(run)
    _marker(run, "j", [[os.getpid(), 1, "h"]])  # nobody holds the run's lock: it ended
    moved = claim_run_dir(str(run), "j")
    assert moved == str(run / "prev" / "1")
    assert sorted(os.listdir(moved)) == ["agent.json", "chaos", "events.jsonl", "logs", MARKER]
    assert (run / "prev" / "1" / "logs" / "rank0.log").read_text() == "old log\n"
    assert not (run / "events.jsonl").exists() and not (run / "chaos").exists()
    assert (run / "ckpt" / "step_000000000004" / "manifest.json").exists()
    assert (run / "token").read_text() == "t" and (run / "report.html").read_text() == "mine"
    # the next reuse by this process replaces its own claim: prev/2
    (run / "events.jsonl").write_text("{}\n")
    assert claim_run_dir(str(run), "j") == str(run / "prev" / "2")


def test_live_agent_of_the_same_job_is_joined_another_job_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _previous_run(run)
    other = _agent_elsewhere(run, "j")  # it rotated the previous run, then wrote its events
    try:
        (run / "events.jsonl").write_text('{"new": 1}\n')
        assert claim_run_dir(str(run), "j") is None  # a node of this launch: share the dir
        assert (run / "events.jsonl").read_text() == '{"new": 1}\n'
        assert sorted(os.listdir(run / "prev")) == ["1"]
        agents = json.loads((run / MARKER).read_text())["agents"]
        assert [a[0] for a in agents] == [other.pid, os.getpid()]
        with pytest.raises(ConfigError, match=r"in use by job 'j'.*another --run-dir") as err:
            claim_run_dir(str(run), "k")
        assert "\n" not in str(err.value) and f"pid {os.getpid()}" in str(err.value)
    finally:
        other.kill()
        other.wait()


def test_a_killed_agent_holds_nothing(tmp_path: Path) -> None:
    """The lock dies with its process, even by SIGKILL: the next launch rotates."""
    run = tmp_path / "run"
    other = _agent_elsewhere(run, "j")
    (run / "events.jsonl").write_text("{}\n")
    other.kill()
    other.wait()
    assert claim_run_dir(str(run), "j") == str(run / "prev" / "1")


@pytest.mark.parametrize("content", ["not json", "[]", '{"v": 2}', "[" * 5000])
def test_broken_marker_counts_as_stale(tmp_path: Path, content: str) -> None:
    run = tmp_path / "run"
    _previous_run(run)
    (run / MARKER).write_text(content)
    assert claim_run_dir(str(run), "j") == str(run / "prev" / "1")


@pytest.mark.timeout(200)
def test_reused_run_dir_resumes_and_reports_only_the_new_run(tmp_path: Path) -> None:
    """Run 12 steps persisting every 4, then the same command for 16 steps in the same
    --run-dir: the second run restores a committed step from disk, ends bit-identical to a
    straight 16-step run, and its report holds only itself (the first run is in prev/1)."""

    def train(run: Path, steps: int, out: Path, extra: list[str]) -> None:
        args = ["--nproc-per-node", "2", *extra, str(EXAMPLE), "--steps", str(steps), *ARGS]
        proc = stalwart_run(run, [*args, "--out", str(out)], timeout=90)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run = tmp_path / "run"
    train(run, 12, tmp_path / "a.pt", ["--persist-every", "4"])
    train(run, 16, tmp_path / "b.pt", ["--persist-every", "4"])
    train(tmp_path / "straight", 16, tmp_path / "c.pt", [])
    resumed = torch.load(tmp_path / "b.pt", weights_only=True)
    straight = torch.load(tmp_path / "c.pt", weights_only=True)
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in resumed)
    events = events_of(run)
    assert [k for k, _ in events].count("run_start") == 1
    restores = [f for k, f in events if k == "restore"]
    # which committed step it resumed from depends on whether the first run's last
    # persists committed before it ended (asynchronous); that it resumed does not
    assert len(restores) == 2 and all(f["tier"] == "disk" for f in restores)
    assert restores[0]["step"] == restores[1]["step"] in (4, 8, 12)
    assert [f["status"] for k, f in events if k == "run_end"] == ["ok"]
    first = events_of(run / "prev" / "1")
    assert [f["last_step"] for k, f in first if k == "run_end"] == [12]
