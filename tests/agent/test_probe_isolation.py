"""A node whose health probe fails is isolated before the fault takes the job down:
blocklisted, its ranks move to the other node, and the job finishes (2 agents on
loopback; node 1's checkpoint disk is "full" by its --probe-limits)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _load import node_lease

from ._launch import events_of, stalwart_run_nodes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
# long enough that the probe fails while training runs: a probe failing after the ranks
# finished does not isolate the node (nothing to move: docs/detection.md), and this test
# is about the isolation
ARGS = ["--steps", "300", "--dim", "32", "--layers", "1", "--seq", "16", "--batch", "4"]


@pytest.mark.timeout(450)
def test_failing_probe_isolates_its_node_and_the_job_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = tmp_path / "out.pt"
    codes = stalwart_run_nodes(
        run,
        2,
        [
            *["--nproc-per-node", "1", "--node-lease", node_lease()],
            *[str(EXAMPLE), *ARGS, "--out", str(out)],
        ],
        per_node={1: ["--probe-limits", "disk_min_free_mb=1e12", "--probe-interval", "0.2"]},
        timeout=400,
    )
    assert codes[0][0] == 0, codes[0][1][-3000:]
    assert codes[1][0] == 3, codes[1][1][-3000:]  # it left like a cordoned node
    assert "probe disk failed" in codes[1][1]
    assert out.exists()
    events = events_of(run)
    failed = [f for k, f in events if k == "probe" and not f["ok"]]
    assert [(f["probe"], f["domain"]["node"]) for f in failed] == [("disk", 1)]
    detected = [f for k, f in events if k == "fault_detected"]
    assert [f["fault"] for f in detected] == ["probe_disk"]
    isolated = [(f["member"], f["blocklisted"]) for k, f in events if k == "isolation"]
    assert isolated == [("node1", True)]
    (end,) = [f for k, f in events if k == "run_end"]
    assert end["status"] == "ok"
    skipped = {f["probe"] for k, f in events if k == "probe" and f["skipped"]}
    assert "nvml" in skipped  # no pynvml or GPU here: said once per node
