"""A node cut from the embedded store only, its data plane intact (issue 25, item 1).

2 agents x 2 workers on loopback. Node 1 reaches node 0's store through a TCP forwarder
this test owns (its agent and workers get the forwarder's address as --rdzv-endpoint);
the gloo data plane and the c10d store stay direct. Mid-run the forwarder turns into a
blackhole: it keeps every connection open and forwards nothing, in either direction,
as a silent partition of the control plane does. Node 1's lease expires in node 0's
store; node 0 bumps the generation and adopts ranks 2-3. Before the fix the original
ranks 2-3 kept training with ranks 0-1 in the old generation to the end, every commit
refused as fenced without a word, and the run ended rc 0 with its newest checkpoint
far behind. Now: ranks 0-1 follow the generation (a watch, under every backend) and
leave the old one at the next step boundary, so the per-rank step journal shows no
run of steps in the old generation after the bump; node 1 exits 3 saying it was
fenced; the parameters equal a fault-free run's bit for bit; the newest checkpoint is
the last step's.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from stalwart.metrics.events import read_events

from ._forwarder import forwarder
from ._launch import _cmd, _free_port, events_of, reap_agents

JOB = Path(__file__).with_name("_cut_job.py")
STEPS = 120
pytestmark = pytest.mark.timeout(420)


def _journal(folder: Path) -> dict[str, list[tuple[int, int, float]]]:
    """Per worker process (``rank-pid``): (generation, step, wall time) per accepted step."""
    out: dict[str, list[tuple[int, int, float]]] = {}
    for path in sorted(folder.glob("*-*")):
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        out[path.name] = [(int(g), int(s), float(t)) for g, s, t in rows]
    return out


def _wait_for_steps(folder: Path, at_least: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"node 0 ended (rc {proc.returncode}) before training")
        done = (
            [rows[-1][1] for rows in _journal(folder).values() if rows] if folder.exists() else []
        )
        if done and min(done) >= at_least:
            return
        time.sleep(0.1)
    pytest.fail(f"the job did not reach step {at_least} within 180 s")


def _run(tmp: Path, name: str, cut_at_step: int | None) -> tuple[list[tuple[int, str]], Path]:
    job = f"test-{uuid.uuid4().hex[:8]}"
    run_dir, journal = tmp / name, tmp / f"{name}-journal"
    port = _free_port()
    script = [str(JOB), "--steps", str(STEPS), "--step-s", "0.1", "--journal", str(journal)]
    script += ["--out", str(tmp / f"{name}.pt")]
    flags = ["--nnodes", "2", "--nproc-per-node", "2", "--node-lease", "2"]
    flags += ["--persist-every", "20"]
    with forwarder(("127.0.0.1", port)) as fwd:
        endpoints = [f"127.0.0.1:{port}", f"127.0.0.1:{fwd.port}"]
        procs = [
            subprocess.Popen(
                _cmd(job, run_dir, [*flags, "--rdzv-endpoint", endpoints[n], "--node-rank", str(n)])
                + script,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=str(tmp),
            )
            for n in (0, 1)
        ]
        try:
            if cut_at_step is not None:
                _wait_for_steps(journal, cut_at_step, procs[0])
                fwd.cut()
        except BaseException:
            for p in procs:
                p.kill()
            raise
        return reap_agents(procs, job, timeout=300), journal


def test_a_node_cut_from_the_store_only_is_fenced_and_trains_nothing_in_an_old_generation(
    tmp_path: Path,
) -> None:
    clean, _ = _run(tmp_path, "ref", None)
    assert [rc for rc, _ in clean] == [0, 0], clean[0][1][-3000:] + clean[1][1][-3000:]
    results, journal = _run(tmp_path, "cut", cut_at_step=30)
    (rc0, err0), (rc1, err1) = results
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 3, err1[-3000:]  # fenced, not "bad input" (2)
    assert "node 1 was fenced" in err1, err1[-3000:]
    events = events_of(tmp_path / "cut")
    log = read_events(str(tmp_path / "cut" / "events.jsonl")).events
    bumps = [(int(e["generation"]), e.t) for e in log if e.kind == "generation" and e["generation"]]
    assert bumps, "node 0 never moved the job past node 1"
    first_gen, bumped_at = bumps[0]
    # the step journal: after the bump, a worker of the old generation finishes the step
    # it is in and at most the next (the watch's event on its way), then leaves it; before
    # the fix, 130 steps here
    late = {
        who: [s for g, s, t in rows if g < first_gen and t > bumped_at]
        for who, rows in _journal(journal).items()
    }
    assert all(len(steps) <= 2 for steps in late.values()), late
    # every step to the end was trained by the current members, none lost or repeated
    final = [rows for who, rows in _journal(journal).items() if rows and rows[-1][1] == STEPS]
    assert len(final) == 4, _journal(journal)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    cut = torch.load(tmp_path / "cut.pt", weights_only=True)
    assert ref.keys() == cut.keys() and all(torch.equal(ref[k], cut[k]) for k in ref)
    persisted = [int(str(f["step"])) for k, f in events if k == "persist_end" and f["ok"]]
    assert persisted and max(persisted) == STEPS, persisted  # no checkpoint lost silently
    refused = [f for k, f in events if k == "persist_end" and not f["ok"]]
    assert not refused or "was refused (generation" in err0 + err1, refused  # said in a line
