"""Warm spares in a real job (issue 28): under ``--strategy spare --standby`` a killed
rank resumes in a process that ran the script's set-up before the kill (its parked
standby), and the result is bit-identical to a fault-free run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from _load import wait_job, wait_until

from ._launch import events_of, stalwart_run, start_run, stop_run

JOB = Path(__file__).resolve().parent / "_warm_spare_job.py"


def _seen(path: Path, what: str) -> list[tuple[int, int]]:
    """(rank, pid) of each 'setup' or 'end' line the job wrote."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(r), int(p)) for w, r, p in (x.split() for x in lines) if w == what]


def _args(tmp: Path, name: str) -> list[str]:
    return [
        "--setups",
        str(tmp / f"{name}.setups"),
        "--release",
        str(tmp / f"{name}.release"),
        "--out",
        str(tmp / f"{name}.pt"),
    ]


@pytest.mark.timeout(300)
def test_a_killed_rank_resumes_in_its_warm_standby_bit_identical(tmp_path: Path) -> None:
    (tmp_path / "ref.release").write_text("")
    ref = stalwart_run(
        tmp_path / "ref", ["--nproc-per-node", "2", str(JOB), *_args(tmp_path, "ref")]
    )
    assert ref.returncode == 0, ref.stderr[-3000:]

    setups = tmp_path / "warm.setups"
    flags = ["--nproc-per-node", "2", "--strategy", "spare", "--spares", "1", "--standby"]
    job, proc = start_run(tmp_path / "warm", [*flags, str(JOB), *_args(tmp_path, "warm")])
    try:
        # both ranks and a standby of each did their set-up: 4 lines, rank 1 twice
        assert wait_until(lambda: len(_seen(setups, "setup")) >= 4, 120), _seen(setups, "setup")
        ones = [pid for rank, pid in _seen(setups, "setup") if rank == 1]
        os.kill(ones[0], signal.SIGKILL)  # the live rank 1 (it wrote its line first)
        (tmp_path / "warm.release").write_text("")
        _, err = wait_job(proc, 120, [tmp_path / "warm" / "events.jsonl"])
    finally:
        stop_run(job, proc)
    assert proc.returncode == 0, err[-3000:]
    events = events_of(tmp_path / "warm")
    joins = [f for k, f in events if k == "member_join" and f.get("member") == "rank1"]
    assert joins[-1].get("standby") is True and joins[-1]["generation"] >= 1, joins
    # rank 1 ended in the process that had done its set-up before the kill
    assert (1, ones[1]) in _seen(setups, "end"), (ones, _seen(setups, "end"))
    assert [f["status"] for k, f in events if k == "run_end"] == ["ok"]
    a = torch.load(tmp_path / "ref.pt", weights_only=True)
    b = torch.load(tmp_path / "warm.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
