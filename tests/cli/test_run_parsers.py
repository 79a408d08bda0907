"""Command-line values of `stalwart run`: one line for every bad value, nothing written.

In-process (``stalwart.cli.main.main``): a bad value is refused before the agent starts,
so no process and no run directory come into being.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.agent.cluster._address import parse_endpoint
from stalwart.agent.cluster.etcd import rdzv_from_file
from stalwart.cli.main import main
from stalwart.coordinator import parse_etcd_url
from stalwart.errors import ConfigError


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('never run')\n")
    return path


def _refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stalwart: error: ") and err.count("\n") == 1, err
    assert needle in err, err
    assert not run_dir.exists(), "a bad command line must write nothing"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--rdzv-endpoint", "127.0.0.1:²"], "not in 1..65535"),
        (["--rdzv-endpoint", "127.0.0.1:0"], "not in 1..65535"),
        (["--rdzv-endpoint", "127.0.0.1:70000"], "not in 1..65535"),
        (["--rdzv-endpoint", "[zz]:29500"], "not an IPv6 address"),
        (["--rdzv-endpoint", "no-port"], "no port"),
        (["--rdzv-endpoint", "bad host:1"], "not a host name"),
        (["--rdzv", "etcd://h:²/j"], "not a number in 1..65535"),
        (["--rdzv", "etcd://[zz]:1/j"], "not an IPv6 address"),
        (["--nproc-per-node", "²"], "use N or MIN:MAX"),
        (["--nnodes", "1:²"], "use N or MIN:MAX"),
        (["--persist-every", "²"], "number of steps"),
        (["--blocklist-after", "0"], "--blocklist-after 0: use 1..1000000"),
        (["--chaos", "kill rank=² at=step:3"], "'rank=²'"),
        (["--chaos", "kill rank=1 at=step:²"], "'at=step:²'"),
        (["--chaos", "kill rank=5 at=step:3", "--nproc-per-node", "2"], "outside the job"),
        (["--chaos", "kill node=1 at=time:3s"], "node 1 is outside the job"),
        (["--tier-keep-last", "10"], "apply to --ckpt-tier: pass it too"),
        (["--ckpt-tier", "s3://b/x", "--tier-keep-last", "0"], "keeps at least 1 checkpoint"),
    ],
)
def test_bad_values_are_one_line_and_write_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    script: Path,
    args: list[str],
    needle: str,
) -> None:
    _refused(tmp_path, capsys, [*args, str(script)], needle)


def test_bad_rdzv_conf_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], script: Path
) -> None:
    conf = tmp_path / "deep.json"
    conf.write_text("[" * 20_000 + "]" * 20_000)
    _refused(tmp_path, capsys, ["--rdzv-conf", str(conf), str(script)], "nested too deep")


def test_endpoint_forms() -> None:
    assert parse_endpoint("10.0.0.5:29500") == ("10.0.0.5", 29500)
    assert parse_endpoint(":29500") == ("127.0.0.1", 29500)
    assert parse_endpoint("[fd00::5]:1") == ("fd00::5", 1)
    assert parse_endpoint("node-7.cluster:65535") == ("node-7.cluster", 65535)
    for bad in ("h:٣", "h:+1", "h: 1", "[::1:1", "[::1]x:1", "h:" + "9" * 5000):
        with pytest.raises(ConfigError, match="--rdzv-endpoint"):
            parse_endpoint(bad)


def test_etcd_url_hosts_and_ports() -> None:
    assert parse_etcd_url("etcd://[::1]:2379,h/j").endpoints == [("::1", 2379), ("h", 2379)]
    for bad in ("etcd://[zz]:1/j", "etcd://[]:1/j", "etcd://h:٣/j", "etcd://h:-1/j", "etcd://é/j"):
        with pytest.raises(ConfigError, match="bad etcd URL"):
            parse_etcd_url(bad)
    with pytest.raises(ConfigError, match="more than 64 endpoints"):
        parse_etcd_url("etcd://" + ",".join(["h"] * 65) + "/j")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"endpoints": [5], "job": "j"}', "expected"),
        ('{"endpoints": ["h:1"], "job": 7}', "expected"),
        ('{"url": "etcd://[zz]:1/j"}', "IPv6"),
        ("[]", "expected"),
        ('{"url": "' + "x" * 70_000 + '"}', "over 64 KiB"),
        (b"\xff\xfe".decode("latin-1"), "not JSON"),
    ],
)
def test_rdzv_conf_shapes(tmp_path: Path, content: str, needle: str) -> None:
    conf = tmp_path / "rdzv.json"
    conf.write_bytes(content.encode("latin-1") if needle == "not JSON" else content.encode())
    with pytest.raises(ConfigError, match=needle) as err:
        rdzv_from_file(str(conf))
    assert "\n" not in str(err.value)


def test_rdzv_conf_directory_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rdzv-conf"):
        rdzv_from_file(str(tmp_path))
    conf = tmp_path / "ok.json"
    conf.write_text(json.dumps({"endpoints": ["[::1]:2379"], "job": "j"}))
    assert rdzv_from_file(str(conf)) == "etcd://[::1]:2379/j"
