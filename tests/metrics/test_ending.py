"""metrics/ending.py: the summary `stalwart run` prints at the end of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stalwart.errors import StalwartError
from stalwart.metrics.ending import end_lines
from stalwart.metrics.report import load_run


def test_the_end_says_status_steps_faults_ettr_and_where_the_run_is(make_run: Any) -> None:
    run = make_run("overlapping")
    d = load_run(str(run)).to_dict()
    lines = end_lines(str(run))
    assert len(lines) == 2
    assert lines[0].startswith("run ok: trained to step 18, 2 faults (2 recovered, RTO p50 5.00s)")
    assert f"ETTR {100 * d['ettr']:.1f}%" in lines[0]
    assert str(run) in lines[1] or "run" in lines[1].split()[2]
    assert "stalwart report" in lines[1] and "--html" in lines[1]
    assert not any("{" in line for line in lines)


def test_a_failed_run_does_not_repeat_its_verdict() -> None:
    from stalwart.metrics.ending import format_end

    d = {"status": "failed", "steps": {"last": 5}, "incidents": [], "rto_s": {}, "ettr": 0.5,
         "run_dir": "/tmp/x", "wall_s": 3.0}  # fmt: skip
    lines = format_end(d)  # the agent printed the verdict once, just above
    assert lines[0].startswith("run failed: trained to step 5, 0 faults")
    assert len(lines) == 2 and not any("why" in line for line in lines)


def test_a_run_without_events_has_no_summary(tmp_path: Path) -> None:
    with pytest.raises(StalwartError):  # the agent prints nothing then
        end_lines(str(tmp_path))
