"""The torchft route's launcher with a stand-in lighthouse: the groups' environment, the
job ending with group 0, and a group still running after the grace stopped (real
torchrun processes; torchft itself is not needed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _load import scaled

from stalwart.cli import _torchft_launch

_LIGHTHOUSE = """\
import socket, sys, time
port = int(sys.argv[sys.argv.index("--bind") + 1].rsplit(":", 1)[1])
s = socket.socket(); s.bind(("127.0.0.1", port)); s.listen()
open(sys.argv[0] + ".args", "w").write(" ".join(sys.argv[1:]))
open(sys.argv[0] + ".pid", "w").write(str(__import__("os").getpid()))
time.sleep(600)
"""

_SCRIPT = """\
import json, os, sys, time
g = int(os.environ["REPLICA_GROUP_ID"])
keys = ("NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
env = {k: os.environ.get(k) for k in keys} | {"pid": os.getpid()}
open(os.path.join(sys.argv[1], f"g{g}.json"), "w").write(json.dumps(env))
if g == 1:
    time.sleep(300)  # still running when group 0 is done: stopped after the grace
"""


def _stand_ins(tmp_path: Path) -> tuple[Path, Path]:
    """The stand-in lighthouse (an executable) and training script, written in tmp_path."""
    lighthouse = tmp_path / "lighthouse"
    lighthouse.write_text(f"#!{sys.executable}\n" + _LIGHTHOUSE)
    lighthouse.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    return lighthouse, script


@pytest.mark.timeout(180)
def test_groups_get_their_ids_and_the_lighthouse_and_the_job_ends_with_group_0(
    tmp_path: Path,
) -> None:
    lighthouse, script = _stand_ins(tmp_path)
    cmd = [sys.executable, "-m", "stalwart.cli._torchft_launch", "--workers", "3"]
    cmd += ["--grace", "1", "--lighthouse", str(lighthouse), "--", str(script), str(tmp_path)]
    env = {"PATH": "/usr/bin:/bin", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(150))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 150  # group 1 did not hold the job for its 300 s
    seen = [json.loads((tmp_path / f"g{g}.json").read_text()) for g in range(3)]
    address = {s["TORCHFT_LIGHTHOUSE"] for s in seen}
    (one,) = address
    assert one.startswith("http://127.0.0.1:") and all(s["NUM_REPLICA_GROUPS"] == "3" for s in seen)
    assert all(s["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] is None for s in seen)  # torchrun's store
    args = (tmp_path / "lighthouse.args").read_text()
    assert "--min_replicas 1" in args and f"--bind 127.0.0.1:{one.rsplit(':', 1)[1]}" in args
    assert not Path(f"/proc/{seen[1]['pid']}").exists()  # stopped, and reaped by its torchrun


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # exited; its parent (gone too) no longer reaps it
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(180)
def test_nothing_it_started_outlives_a_launcher_killed_by_sigkill(tmp_path: Path) -> None:
    lighthouse, script = _stand_ins(tmp_path)
    cmd = [sys.executable, "-m", "stalwart.cli._torchft_launch", "--workers", "2"]
    cmd += ["--lighthouse", str(lighthouse), "--", str(script), str(tmp_path)]
    proc = subprocess.Popen(cmd, env={"PATH": "/usr/bin:/bin"}, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "g1.json").exists():
            time.sleep(0.1)
        group1 = json.loads((tmp_path / "g1.json").read_text())["pid"]  # sleeping 300 s
        keeper = int((tmp_path / "lighthouse.pid").read_text())
    finally:
        proc.kill()  # no handler runs: the children learn it from the kernel
        proc.wait(timeout=scaled(30))
    assert _gone(keeper, 30), "the lighthouse outlived its launcher"
    assert _gone(group1, 60), "a replica group's worker outlived the launcher"


def test_without_a_lighthouse_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_torchft_launch, "lighthouse_binary", lambda: None)
    assert _torchft_launch.main(["--workers", "2", "--", "x.py"]) == 2
    assert "pip install '.[bench]'" in capsys.readouterr().err
