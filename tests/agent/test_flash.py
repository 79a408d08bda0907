"""The key invariant: a run with failures recovered in place ends with the same
parameters, bit for bit, as a run without faults (CPU, deterministic ops)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _load import Deadline, node_lease, scaled

from ._launch import events_of, stalwart_run, stalwart_run_nodes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
ARGS = ["--steps", "24", "--dim", "32", "--layers", "1", "--seq", "16", "--batch", "4"]


def _load(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return state


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def _train(run_dir: Path, extra: list[str]) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}.pt"
    proc = stalwart_run(
        run_dir,
        ["--nproc-per-node", "2", *extra, str(EXAMPLE), *ARGS, "--out", str(out)],
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _load(out)


@pytest.mark.timeout(300)
def test_flash_spare_restart_recover_bit_identical(tmp_path: Path) -> None:
    reference = _train(tmp_path / "ref", [])
    chaos = ["--chaos", "kill rank=1 at=step:5; hang rank=0 at=step:15"]
    _same(reference, _train(tmp_path / "flash", chaos))
    events = events_of(tmp_path / "flash")
    assert [f["fault"] for k, f in events if k == "fault_detected"] == ["crash", "hang"]
    ends = [f for k, f in events if k == "recovery_end"]
    assert len(ends) == 2 and all(f["source_tier"] == "memory" for f in ends)
    assert [f["status"] for k, f in events if k == "run_end"] == ["ok"]

    restart = [
        "--strategy",
        "restart",
        "--max-restarts",
        "1",
        "--persist-every",
        "2",
        "--chaos",
        "kill rank=0 at=step:20",
    ]
    _same(reference, _train(tmp_path / "restart", restart))
    ends = [f for k, f in events_of(tmp_path / "restart") if k == "recovery_end"]
    # the newest committed persist at the kill (one at a time, so maybe not the newest step)
    assert [f["source_tier"] for f in ends] == ["disk"]
    assert ends[0]["restored_step"] % 2 == 0 and 0 < ends[0]["restored_step"] < 20


@pytest.mark.timeout(300)
def test_two_nodes_kill_hang_node_loss_and_restart(
    tmp_path: Path, two_node_reference: dict[str, torch.Tensor]
) -> None:
    """2 agents x 2 workers on loopback; node 1 is lost and node 0 adopts its ranks,
    which restore from a peer's snapshot. Then the restart route across both nodes. Each
    run ends bit-identical to the fault-free one (``two_node_reference``: tests/agent/
    conftest.py, shared with the other tests of that shape)."""
    results = {"ref": two_node_reference}
    for name, chaos in [
        (
            "chaos",
            ["--chaos", "kill rank=1 at=step:5; hang rank=2 at=step:12; kill node=1 at=step:18"],
        ),
        # isolation: node 1 fails 3 times, cordons itself, node 0 adopts its ranks
        (
            "cordon",
            ["--chaos", "kill rank=2 at=step:4; kill rank=3 at=step:9; kill rank=2 at=step:14"],
        ),
        # torchrun's route across nodes: node 1's failure restarts node 0's workers too
        (
            "restart",
            [
                "--strategy",
                "restart",
                "--max-restarts",
                "1",
                "--persist-every",
                "4",
                "--chaos",
                "kill rank=3 at=step:14",
            ],
        ),
    ]:
        out = tmp_path / f"{name}.pt"
        codes = stalwart_run_nodes(
            tmp_path / name,
            2,
            [
                "--nproc-per-node",
                "2",
                "--node-lease",
                node_lease(),
                *chaos,
                str(EXAMPLE),
                *ARGS,
                "--out",
                str(out),
            ],
        )
        assert codes[0][0] == 0, codes[0][1][-3000:]
        results[name] = _load(out)
    _same(results["ref"], results["chaos"])
    _same(results["ref"], results["restart"])
    _same(results["ref"], results["cordon"])
    isolated = [f for k, f in events_of(tmp_path / "cordon") if k == "isolation"]
    assert [(f["member"], f["blocklisted"]) for f in isolated] == [("node1", True)]
    restarted = [f for k, f in events_of(tmp_path / "restart") if k == "recovery_begin"]
    assert [f["strategy"] for f in restarted] == ["restart"]
    events = events_of(tmp_path / "chaos")
    detected = [f["fault"] for k, f in events if k == "fault_detected"]
    assert detected == ["crash", "hang", "node_loss"]
    tiers = [f["source_tier"] for k, f in events if k == "recovery_end"]
    assert tiers[-1] == "peer"


def _complete_events(path: Path) -> list[dict[str, object]]:
    """The events of a log that is still being written: only newline-terminated lines.
    A reader racing an append can see the last line half written (a torn read), so a
    live log must not go through ``events_of``, which reports that as a problem."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")[:-1]  # the last piece has no newline yet
    return [json.loads(line) for line in lines if line.strip()]


def _wait_for(
    proc: subprocess.Popen[str], what: str, base_s: float, done: Callable[[], bool]
) -> None:
    """Wait for ``done``: ``base_s`` on a quiet machine, scaled for the load (_load.py)."""
    deadline = Deadline(base_s)
    while not done():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) while waiting for {what}")
        if deadline.expired():
            pytest.fail(f"no {what} in {deadline.describe()}")
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_live_chaos_against_a_running_job(tmp_path: Path) -> None:
    from stalwart.cli.chaos import queue_faults
    from stalwart.errors import ConfigError

    run_dir = tmp_path / "live"
    events = run_dir / "events.jsonl"
    job = f"test-{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable,
        "-m",
        "stalwart.cli.main",
        "run",
        "--rdzv-id",
        job,
        "--run-dir",
        str(run_dir),
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        *ARGS[:1],
        "100000",
        *ARGS[2:],
    ]
    # output to a file, not a pipe nobody reads while the run goes on (a full pipe
    # would block the agent and its workers)
    out = (tmp_path / "live.log").open("w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    exited_by_itself = False
    try:
        # separate deadlines: start-up under load can take long, and must not eat the
        # recovery's time
        _wait_for(
            proc,
            "training steps",
            150,
            lambda: any(e["kind"] == "steps" for e in _complete_events(events)),
        )
        with pytest.raises(ConfigError, match="'rank=one'"):
            queue_faults(str(run_dir), "kill rank=one")
        # garbage and an unauthenticated frame on the store's port: rejected, run goes on
        host, port = json.loads((run_dir / "agent.json").read_text())["store"].split(":")
        for junk in (b"GET / HTTP/1.0\r\n\r\n", b"\x00\x00\x00\x10" + b"x" * 16):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(junk)
                s.settimeout(5)
                try:
                    while s.recv(4096):
                        pass
                except OSError:
                    pass
        spec = queue_faults(str(run_dir), "kill rank=1")

        def recovered_from_our_fault() -> bool:
            # a recovery that follows *this* fault: under load the hang detector may
            # have recovered something earlier, which must not end the wait
            kinds = [(e["kind"], e.get("spec")) for e in _complete_events(events)]
            fired = [i for i, (k, sp) in enumerate(kinds) if k == "fault_injected" and sp == spec]
            return bool(fired) and any(k == "recovery_end" for k, _ in kinds[fired[0] :])

        _wait_for(proc, f"recovery after {spec!r}", 120, recovered_from_our_fault)
    finally:
        proc.terminate()  # the agent we started: SIGTERM ends its run and cleans up
        stop_s = scaled(60)
        try:
            proc.wait(timeout=stop_s)
            exited_by_itself = True
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.seek(0)
        log = out.read()
        out.close()
    assert exited_by_itself, f"the agent did not exit {stop_s:.0f} s after SIGTERM:\n{log[-3000:]}"
    # the agent has exited: the log is complete and its cleanup is done
    logged = events_of(run_dir)
    kinds = [k for k, _ in logged]
    assert "fault_injected" in kinds and "fault_detected" in kinds, log[-3000:]
    assert [f["status"] for k, f in logged if k == "run_end"] == ["terminated"]
    assert not [p for p in os.listdir("/dev/shm") if job in p], log[-3000:]
