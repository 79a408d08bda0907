"""`--rdzv etcd://...` / `--rdzv-conf` validation and the ring of buddies, without processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.agent.cluster._cluster import ring_successor
from stalwart.agent.cluster.etcd import rdzv_from_file
from stalwart.agent.config import LaunchConfig
from stalwart.errors import ConfigError


def test_rdzv_conf_file_forms(tmp_path: Path) -> None:
    conf = tmp_path / "rdzv.json"
    conf.write_text(json.dumps({"endpoints": ["10.0.0.5:2379", "10.0.0.6"], "job": "job7"}))
    assert rdzv_from_file(str(conf)) == "etcd://10.0.0.5:2379,10.0.0.6/job7"
    conf.write_text(json.dumps({"url": "etcd://h:1/j"}))
    assert rdzv_from_file(str(conf)) == "etcd://h:1/j"
    conf.write_text(json.dumps({"endpoints": ["h:1"], "job": "a/b"}))
    with pytest.raises(ConfigError, match="job id"):
        rdzv_from_file(str(conf))
    conf.write_text("endpoints = [1]")
    with pytest.raises(ConfigError, match="not JSON"):
        rdzv_from_file(str(conf))
    with pytest.raises(ConfigError, match="rdzv-conf"):
        rdzv_from_file(str(tmp_path / "missing.json"))


def test_launch_config_takes_the_job_id_from_the_url(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    cfg = LaunchConfig(str(script), nnodes=2, rdzv="etcd://127.0.0.1:2379/j1", job="j1")
    assert cfg.etcd and cfg.world_size == 2
    with pytest.raises(ConfigError, match="drop --rdzv-id"):
        LaunchConfig(str(script), rdzv="etcd://127.0.0.1:2379/j1", job="other")
    with pytest.raises(ConfigError, match="bad etcd URL"):
        LaunchConfig(str(script), rdzv="http://127.0.0.1:2379/j1", job="j1")
    with pytest.raises(ConfigError, match="replica-rate"):
        LaunchConfig(str(script), replica_rate_mb_s=-1)


def test_ring_successor_skips_the_dead_and_wraps() -> None:
    assert ring_successor(0, {0, 1, 2}) == 1
    assert ring_successor(2, {0, 1, 2}) == 0
    assert ring_successor(1, {0, 2, 3}) == 2  # node 1 lost: node 2 adopts it
    assert ring_successor(3, {0, 1}) == 0
    assert ring_successor(0, {0}) is None
