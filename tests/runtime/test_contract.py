"""The agent-to-worker contract (contract/env.py): one round trip, one version, bounds."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _load import scaled

from stalwart.agent.config import LaunchConfig
from stalwart.agent.processes._env import NodeFacts, WorkerSpec, worker_contract, worker_environ
from stalwart.contract.env import CONTRACT_VAR, CONTRACT_VERSION, DEFAULTS, WorkerEnv
from stalwart.errors import ContractError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "worker-contract.md"


def _full() -> WorkerEnv:
    """A contract with no field at its default."""
    return WorkerEnv(
        rank=2,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        node_rank=1,
        nnodes=2,
        master_addr="node0.example",
        master_port=29500,
        restart_count=1,
        max_restarts=5,
        job="j1",
        agent_store=True,
        strategy="elastic",
        run_dir="/runs/j1",
        store=("10.0.0.1", 4000),
        token_file="/runs/j1/token",
        c10d_addr="10.0.0.1:4001",
        rdzv="etcd://h:2379/j1",
        fence="1:17",
        progress="/dev/shm/board",
        progress_slot=3,
        chaos_plan="/runs/j1/chaos/plan.json",
        error_line="/runs/j1/errors/rank2.txt",
        hang_ceiling_s=120.0,
        watch_wait_s=30.0,
        gen_relay="@stalwart-gen-0123456789abcdef01234567",
        arrival_relay="@stalwart-arr-0123456789abcdef01234567",
        persist_every=-1,
        snapshot_budget=0.05,
        snapshot_every=7,
        collective_timeout_s=60.0,
        keep_last=2,
        keep_every=100,
        ckpt_tier="s3://bucket/j1",
        s3_endpoint="http://127.0.0.1:9000",
        min_world=2,
        elastic_wait_s=30.0,
        replica_groups=4,
        sync_every=20,
        outer_lr=0.5,
        outer_momentum=0.8,
        incarnation="abcd1234",
        step_p99_s=0.25,
        standby="/dev/shm/go",
        shm_run="5f2c9a10",
        sdc_every=7,
        on_sdc="evict",
        on_nan="rollback",
        spike_z=4.5,
        spike_window=30,
    )


def test_every_field_survives_the_round_trip_and_none_is_at_its_default() -> None:
    env = _full()
    for f in dataclasses.fields(WorkerEnv):
        if f.name != "version":
            assert getattr(env, f.name) != getattr(DEFAULTS, f.name), f.name
    assert WorkerEnv.from_environ(env.to_environ()) == env
    assert WorkerEnv.from_environ(DEFAULTS.to_environ()) == DEFAULTS


def test_torchrun_variables_are_written_as_torchrun_writes_them() -> None:
    out = _full().to_environ()
    assert (out["RANK"], out["WORLD_SIZE"], out["LOCAL_RANK"]) == ("2", "4", "1")
    assert (out["ROLE_RANK"], out["ROLE_WORLD_SIZE"], out["ROLE_NAME"]) == ("2", "4", "default")
    assert (out["GROUP_RANK"], out["GROUP_WORLD_SIZE"], out["LOCAL_WORLD_SIZE"]) == ("1", "2", "2")
    assert (out["MASTER_ADDR"], out["MASTER_PORT"]) == ("node0.example", "29500")
    assert out["TORCHELASTIC_RUN_ID"] == "j1"
    assert out["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    # the rest travels as one JSON object, never as loose STALWART_* variables
    assert [k for k in out if k.startswith("STALWART_")] == [CONTRACT_VAR]
    assert json.loads(out[CONTRACT_VAR])["version"] == CONTRACT_VERSION


def test_without_the_contract_a_torchrun_worker_reads_torchrun_only() -> None:
    env = WorkerEnv.from_environ(
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    )
    assert (env.rank, env.world_size, env.c10d, env.managed) == (1, 2, ("h", 29500), False)
    assert env.job == "local" and env.strategy == DEFAULTS.strategy
    # stray old-style variables in a user's shell are not part of the contract
    assert WorkerEnv.from_environ({"STALWART_STANDBY": "/x", "STALWART_KEEP_LAST": "9"}) == DEFAULTS


def test_the_agent_store_wins_over_master_addr_and_etcd_falls_back_to_it() -> None:
    env = dataclasses.replace(_full(), c10d_addr="")
    assert env.c10d == ("node0.example", 29500)
    assert _full().c10d == ("10.0.0.1", 4001)


def test_another_version_is_refused_in_one_line_naming_the_fix() -> None:
    out = _full().to_environ()
    blob = json.loads(out[CONTRACT_VAR])
    blob["version"] = CONTRACT_VERSION + 1
    blob["a_field_of_the_future"] = 1  # the version is checked before any field
    out[CONTRACT_VAR] = json.dumps(blob)
    with pytest.raises(ContractError) as err:
        WorkerEnv.from_environ(out)
    text = str(err.value)
    assert "\n" not in text and f"version {CONTRACT_VERSION + 1}" in text
    assert "different stalwart installations" in text


@pytest.mark.parametrize(
    "raw", ["not json", "[1, 2]", json.dumps({"store": "x"}), json.dumps({"version": "1"})]
)
def test_a_malformed_contract_is_refused(raw: str) -> None:
    with pytest.raises(ContractError, match=CONTRACT_VAR):
        WorkerEnv.from_environ({CONTRACT_VAR: raw})


def test_an_unknown_field_is_refused_by_name() -> None:
    raw = json.dumps({"version": CONTRACT_VERSION, "keep_lats": 3})
    with pytest.raises(ContractError, match="keep_lats"):
        WorkerEnv.from_environ({CONTRACT_VAR: raw})


def _blob(**fields: object) -> dict[str, str]:
    return {CONTRACT_VAR: json.dumps({"version": CONTRACT_VERSION, **fields})}


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4"),
        ({"RANK": "-1"}, "RANK=-1"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
        ({"MASTER_PORT": "-5"}, "MASTER_PORT=-5"),
        ({"TORCHELASTIC_RESTART_COUNT": "-1"}, "TORCHELASTIC_RESTART_COUNT=-1"),
        (_blob(keep_last=0), "keep_last=0 is out of bounds (need >= 1): set --keep-last"),
        (_blob(keep_every=-1), "keep_every=-1"),
        (_blob(persist_every=-2), "persist_every=-2"),
        (_blob(snapshot_budget=-0.1), "snapshot_budget=-0.1"),
        (_blob(snapshot_every=-1), "snapshot_every=-1"),
        (_blob(collective_timeout_s=0), "collective_timeout_s=0 is out of bounds (need > 0)"),
        (_blob(hang_ceiling_s=0.0), "hang_ceiling_s=0.0"),
        (_blob(elastic_wait_s=-1), "elastic_wait_s=-1"),
        (_blob(min_world=0), "min_world=0"),
        (_blob(progress_slot=-1), "progress_slot=-1"),
        (_blob(step_p99_s=-0.5), "step_p99_s=-0.5"),
        (_blob(step_p99_s="fast"), "step_p99_s='fast' is not a finite number"),
        (_blob(keep_last=2.5), "keep_last=2.5 is not an integer"),
        (_blob(keep_last=True), "keep_last=True is not an integer"),
        (_blob(run_dir=3), "run_dir=3 is not a string"),
        (_blob(strategy="bogus"), "strategy='bogus' is not a strategy"),
        (_blob(store="nohost"), "store='nohost' is not HOST:PORT"),
        (_blob(c10d_addr="h:99999"), "c10d_addr='h:99999' is not HOST:PORT"),
        # issue 27: int() takes non-ASCII digits, spaces and underscores; the contract not
        ({"RANK": "\u0663"}, "RANK='\u0663' is not an integer"),
        ({"RANK": " 3"}, "RANK=' 3' is not an integer"),
        ({"WORLD_SIZE": "1_0"}, "WORLD_SIZE='1_0' is not an integer"),
        ({"MASTER_PORT": "\u0968\u0969"}, "is not an integer"),
        ({"RANK": "9" * 5000}, "is not an integer"),
        (_blob(c10d_addr="h:\u0663\u0663"), "is not HOST:PORT"),
        ({"TORCHELASTIC_RUN_ID": "a/b"}, "TORCHELASTIC_RUN_ID='a/b' is not a job id"),
        ({"TORCHELASTIC_RUN_ID": "../../etc"}, "is not a job id"),
        ({"TORCHELASTIC_RUN_ID": "a\x00b"}, "is not a job id"),
        ({"TORCHELASTIC_RUN_ID": "j\u00f6b"}, "is not a job id"),
        ({"TORCHELASTIC_RUN_ID": "a b"}, "is not a job id"),
        ({"TORCHELASTIC_RUN_ID": "j" * 201}, "is not a job id"),
        (_blob(shm_run="../x"), "shm_run='../x' is not a run id"),
        (_blob(shm_run="ab\x00"), "is not a run id"),
    ],
)
def test_each_bound_is_refused_naming_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(ContractError) as err:
        WorkerEnv.from_environ(env)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_the_agent_writes_its_config_into_the_contract(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = LaunchConfig(
        script=str(script),
        nproc_per_node=2,
        job="jx",
        strategy="spare",
        spares=1,
        runtime=WorkerEnv(keep_last=5, snapshot_every=4, collective_timeout_s=9.0),
    )
    node = NodeFacts(
        run_dir=str(tmp_path),
        store="127.0.0.1:4000",
        token_file="/t",
        c10d="127.0.0.1:4001",
        progress="/dev/shm/b",
        chaos_plan="/p",
        master_addr="fqdn",
    )
    env = worker_contract(
        cfg,
        WorkerSpec(rank=1, local=1, slot=1),
        node,
        restarts=2,
        master_port=29400,
        fields={"incarnation": "i1", "step_p99_s": 0.5},
    )
    got = WorkerEnv.from_environ(worker_environ(env))
    assert got == env
    assert (got.rank, got.world_size, got.strategy, got.job) == (1, 2, "spare", "jx")
    assert (got.keep_last, got.snapshot_every, got.collective_timeout_s) == (5, 4, 9.0)
    assert (got.store, got.c10d, got.restart_count) == (("127.0.0.1", 4000), ("127.0.0.1", 4001), 2)
    assert (got.incarnation, got.step_p99_s, got.master_addr) == ("i1", 0.5, "fqdn")


def test_a_policy_may_set_the_rank_and_world_size(tmp_path: Path) -> None:
    """A sharded elastic job restarted at 3 of its 4 launch ranks: launch rank 3 runs as
    rank 2 of 3 (agent/strategies/_elastic.py); the RANK/WORLD_SIZE variables say so."""
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = LaunchConfig(script=str(script), nproc_per_node=4, job="jr", strategy="elastic")
    node = NodeFacts(str(tmp_path), "127.0.0.1:4000", "/t", "127.0.0.1:4001", "/b", "/p")
    spec = WorkerSpec(rank=3, local=3, slot=3)
    env = worker_contract(
        cfg, spec, node, restarts=1, master_port=1, fields={"rank": 2, "world_size": 3}
    )
    environ = worker_environ(env)
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"]) == ("2", "3", "3")
    plain = worker_contract(cfg, spec, node, restarts=0, master_port=1, fields={})
    assert (plain.rank, plain.world_size) == (3, 4)


def test_every_field_is_documented() -> None:
    text = DOCS.read_text()
    for f in dataclasses.fields(WorkerEnv):
        carrier = f.metadata["var"] or f.name
        assert f"`{carrier}`" in text, f"docs/worker-contract.md does not describe {carrier}"


def test_importing_the_contract_imports_no_torch() -> None:
    """The agent imports it, and the agent never imports torch."""
    code = "import sys, stalwart.agent.agent; sys.exit('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=scaled(60))
