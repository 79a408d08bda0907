"""A node cut from etcd itself (its link to etcd gone, etcd up for everyone else) learns
it within a bound set by its lease, not after a 30 s request and a 60 s reconnect
(issue 25): the agent's etcd calls are bounded as the embedded store's are
(agent/cluster/etcd.py, docs/etcd.md), and an etcd restart is still ridden out
(tests/agent/test_etcd_faults.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from coordinator.etcd_server import running_etcd

from stalwart.agent.cluster.etcd import ETCD_RIDE_OUT_S, agent_etcd_config, open_etcd
from stalwart.agent.config import LaunchConfig
from stalwart.coordinator import StoreUnavailableError

from .._forwarder import forwarder

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_the_agents_etcd_calls_are_bounded_by_the_lease() -> None:
    short, long = agent_etcd_config(3.0), agent_etcd_config(20.0)
    assert short.request_timeout == 1.5 and short.reconnect_timeout == ETCD_RIDE_OUT_S
    assert long.request_timeout == 10.0 and long.reconnect_timeout == 40.0
    assert long.marker_ttl >= 2 * long.reconnect_timeout  # exactly-once retries hold


def test_an_agent_cut_from_etcd_gives_up_after_the_bounded_reconnect(tmp_path: Path) -> None:
    with running_etcd() as etcd, forwarder(("127.0.0.1", etcd.client_port)) as fwd:
        job = f"cut-{uuid.uuid4().hex[:6]}"
        (tmp_path / "train.py").write_text("")
        cfg = LaunchConfig(
            str(tmp_path / "train.py"),
            rdzv=f"etcd://127.0.0.1:{fwd.port}/{job}",
            job=job,
            token_file=str(tmp_path / "token"),
            node_lease_s=1.0,
        )
        store, _ = open_etcd(cfg)
        try:
            store.put(f"/stalwart/{job}/probe", b"1")
            fwd.cut()  # a silent blackhole: no reply, no RST
            with pytest.raises(StoreUnavailableError) as err:
                store.get(f"/stalwart/{job}/probe")
            # the agent's bound (its lease, at least the ride-out), not a minute
            assert f"unreachable for {ETCD_RIDE_OUT_S:.1f}s" in str(err.value), err.value
        finally:
            fwd.heal()
            store.close()
