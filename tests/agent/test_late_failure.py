"""A rank that fails after its peer finished the job (``--strategy flash``): the job
ends at once with one line, the failed rank's, instead of starting a replacement that
waits for a peer that is gone (300 s, then again)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._launch import events_of, stalwart_run

JOB = Path(__file__).resolve().parent / "_late_failure_job.py"


@pytest.mark.timeout(240)
def test_a_failure_after_the_peer_exited_0_ends_the_job_with_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--nproc-per-node", "2", "--strategy", "flash", str(JOB), "--steps", "6"]
    proc = stalwart_run(run_dir, args, timeout=150)  # a replacement would wait 300 s
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("stalwart: rank 1 failed")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "OSError: final save failed" in lines[0] and "when rank 0 had finished" in lines[0]
    events = events_of(run_dir)
    joins = [f["member"] for k, f in events if k == "member_join"]
    assert sorted(joins) == ["rank0", "rank1"]  # nobody was started again
    (end,) = [f for k, f in events if k == "run_end"]
    assert end["status"] == "failed" and "rank 1 failed" in end["reason"]
