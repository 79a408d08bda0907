"""`stalwart run --rdzv etcds://...` against a real etcd: the three faults of issue 7.

The etcd is the one a production job meets (tests/coordinator/etcd_secure.py): TLS with
client certificates and auth on, each job logged in as its own user whose role grants only
its prefix; the plain-etcd transport is covered by the store conformance suite.
2 agents x 2 workers on loopback, the small LM of test_flash.py. After each fault the
final parameters must equal a fault-free run's (same world size) bit for bit:
(a) node 0 (the agent that started the job) is SIGKILLed with its workers;
(b) etcd is SIGKILLed and restarted on the same data dir mid-run;
(c) node 1's agent is SIGSTOPped past its lease: it is fenced, its ranks move to node 0,
    and when it resumes it stops its workers and leaves (exit 3) without committing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from _load import scaled, wait_job
from coordinator.etcd_secure import SecureEtcd, running_secure_etcd
from coordinator.etcd_server import EtcdServer

from stalwart.coordinator import Coordinator, CoordinatorConfig, EtcdStore
from stalwart.errors import FencedError

from ._launch import events_of, start_etcd_agents

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
ARGS = ["--steps", "300", "--dim", "32", "--layers", "1", "--seq", "16", "--batch", "4"]

pytestmark = pytest.mark.timeout(240)

Hook = Callable[[list[subprocess.Popen[str]], Path, EtcdServer], None]


JOBS = [f"etcd-{uuid.uuid4().hex[:8]}" for _ in range(8)]  # a user each, made at start


@pytest.fixture(scope="module")
def etcd() -> Iterator[SecureEtcd]:
    with running_secure_etcd(jobs=JOBS) as secure:
        yield secure


def _run(
    etcd: SecureEtcd,
    run_dir: Path,
    extra: Sequence[str] = (),
    during: Hook | None = None,
    script: Sequence[str] = (),
) -> tuple[str, list[tuple[int, str]], dict[str, torch.Tensor]]:
    """The job (``extra``: the launch's flags; ``script``: more of the script's own)."""
    job = JOBS.pop()
    url = etcd.job_url(job)
    out = run_dir.parent / f"{run_dir.name}.pt"
    procs = start_etcd_agents(
        url, run_dir, [*extra, str(EXAMPLE), *ARGS, *script, "--out", str(out)]
    )
    results = []
    failed = True
    try:
        if during is not None:
            during(procs, run_dir, etcd.server)
        for p in procs:
            _, err = wait_job(p, 150, [run_dir / "events.jsonl"])
            results.append((p.returncode, err))
        failed = False
    finally:
        said = []
        for node, p in enumerate(procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                try:
                    said.append((node, p.communicate(timeout=scaled(20))[1]))
                except subprocess.TimeoutExpired:
                    p.kill()
                    said.append((node, p.communicate()[1]))
        if failed:  # what the agents said goes with the failure (pytest prints it)
            for node, err in said:
                print(f"--- node {node}'s agent, its last lines:\n{(err or '')[-4000:]}")
    assert not [p for p in os.listdir("/dev/shm") if job in p], "shared memory left behind"
    params: dict[str, torch.Tensor] = {}
    if out.exists():
        params = torch.load(out, weights_only=True)
    return url, results, params


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a and a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def _wait_event(run_dir: Path, pred: Callable[[str, dict[str, object]], bool], t: float) -> None:
    deadline = time.monotonic() + scaled(t)
    path = run_dir / "events.jsonl"
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if pred(str(doc.get("kind")), doc):
                    return
        time.sleep(0.05)
    raise AssertionError("the awaited event did not come")


def _training(kind: str, doc: dict[str, object]) -> bool:
    return kind == "steps"


@pytest.fixture(scope="module")
def reference(
    etcd: SecureEtcd, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, torch.Tensor]:
    _, results, params = _run(etcd, tmp_path_factory.mktemp("ref") / "ref")
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    return params


def test_job_survives_the_loss_of_node_0(
    etcd: SecureEtcd, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    run_dir = tmp_path / "node0"
    _, results, params = _run(etcd, run_dir, ["--chaos", "kill node=0 at=step:15"])
    assert results[0][0] == 137  # node 0 killed itself (agent, zygote, workers)
    assert results[1][0] == 0, results[1][1][-3000:]
    # node 0 prints the end-of-run summary; it is gone, so the node that ended the run does
    assert "stalwart: run ok: trained to step" in results[1][1], results[1][1][-3000:]
    _same(reference, params)
    events = events_of(run_dir)
    lost = [f for k, f in events if k == "fault_detected"]
    assert [(f["fault"], f["domain"]["node"]) for f in lost] == [("node_loss", 0)]  # type: ignore[index]
    assert [f["status"] for k, f in events if k == "run_end"] == ["ok"]
    # every recovery restored from the peer replicas; how many recoveries the loss took
    # depends on timing (a formation that fails under load is redone: seen once in CI-like
    # runs with a second suite beside it)
    tiers = [f["source_tier"] for k, f in events if k == "recovery_end"]
    assert tiers and set(tiers) == {"peer"}, tiers


def _history(url: str, key: str) -> list[dict[str, object]]:
    """Every value ``key`` ever had in the job's etcd (history is not compacted)."""
    store = EtcdStore.from_url(url)
    try:
        full = f"/stalwart/{store.job_id}/{key}"
        with store.watch(full, 1) as watch:
            values = []
            while batch := watch.get(1.0):
                values += [json.loads(e.kv.value) for e in batch if e.type == "put"]
        return [v for v in values if isinstance(v, dict)]
    finally:
        store.close()


def test_etcd_restart_mid_run_pauses_and_commits_nothing_twice(
    etcd: SecureEtcd, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    restarted: list[float] = []

    def bounce(procs: list[subprocess.Popen[str]], run_dir: Path, server: EtcdServer) -> None:
        _wait_event(run_dir, _training, 90)
        server.kill()
        time.sleep(1.0)  # the job keeps computing; commits wait for etcd
        server.start()
        restarted.append(time.time())

    url, results, params = _run(etcd, tmp_path / "bounce", ["--persist-every", "10"], bounce)
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    _same(reference, params)
    steps = _history(url, "step")
    seen = [(s["generation"], s["step"]) for s in steps]
    assert len(seen) == len(set(seen)), f"a step was committed twice: {seen}"
    assert any(float(s["at"]) > restarted[0] for s in steps)  # it went on after the restart
    ckpts = [c["step"] for c in _history(url, "ckpt_latest")]
    assert ckpts and len(ckpts) == len(set(ckpts)), f"a checkpoint was committed twice: {ckpts}"


def test_a_stopped_agent_is_fenced_and_leaves(
    etcd: SecureEtcd, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    def stop_node_1(procs: list[subprocess.Popen[str]], run_dir: Path, _: EtcdServer) -> None:
        _wait_event(run_dir, _training, 90)
        os.kill(procs[1].pid, signal.SIGSTOP)
        try:  # the job goes on without it: node 0 adopts its ranks and they recover
            _wait_event(run_dir, lambda k, d: k == "recovery_end", 90)
        finally:
            os.kill(procs[1].pid, signal.SIGCONT)

    run_dir = tmp_path / "stop"
    # steps of at least 0.1 s (the same parameters): node 1's lease, the partition grace
    # and the recovery all fall inside the job however fast the machine (at 30 ms a step
    # the job ended before the grace did, with nothing fenced)
    url, results, params = _run(etcd, run_dir, [], stop_node_1, ["--step-s", "0.1"])
    assert results[0][0] == 0, results[0][1][-3000:]
    assert results[1][0] == 3, results[1][1][-3000:]
    assert "node 1 was fenced" in results[1][1]
    _same(reference, params)
    events = events_of(run_dir)
    assert ("node_loss", 1) in [
        (f["fault"], f["domain"]["node"])  # type: ignore[index]
        for k, f in events
        if k == "fault_detected"
    ]
    fenced = [f for k, f in events if k == "isolation" and f["member"] == "node1"]
    assert "fenced" in str(fenced[-1]["reason"])
    # nothing was committed with an old generation once the job had moved on
    gens = [int(str(r["generation"])) for r in _history(url, "step")]
    assert gens and gens == sorted(gens) and gens[-1] > 0, gens
    # the generation it was fenced in can commit nothing any more
    store = EtcdStore.from_url(url)
    try:
        coord = Coordinator(store, CoordinatorConfig(job_id=store.job_id))
        with pytest.raises(FencedError):
            coord.commit_step(0, 10_000, "node1")
    finally:
        store.close()
