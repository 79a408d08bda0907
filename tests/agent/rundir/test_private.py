"""The run directory is the job user's: 0700 whatever the umask, records 0600, and one
that another user owns or could write is refused in one line (docs/security.md)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stalwart.agent._lifecycle import write_agent_json
from stalwart.agent.rundir._claim import MARKER, claim_run_dir
from stalwart.agent.rundir._private import make_private_dir, owned_file, write_private
from stalwart.errors import ConfigError
from stalwart.metrics import EventLog

_root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
OTHER_UID = 65534  # nobody


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def loose_umask() -> object:
    old = os.umask(0o002)  # a umask that would leave files group-writable
    yield
    os.umask(old)


def test_a_new_run_dir_and_its_records_are_private(tmp_path: Path, loose_umask: object) -> None:
    run = tmp_path / "runs" / "job7"
    claim_run_dir(str(run), "job7")
    assert _mode(run) == 0o700
    assert _mode(run / ".lock") == 0o600 and _mode(run / MARKER) == 0o600
    assert _mode(run / ".running") == 0o600
    write_agent_json(str(run), "job7", "127.0.0.1:1")
    assert _mode(run / "agent.json") == 0o600
    log = EventLog(str(run / "events.jsonl"))
    log.emit("note", message="x")
    log.close()
    assert _mode(run / "events.jsonl") == 0o600


def test_a_reused_run_dirs_rotation_and_chaos_plan_are_private(
    tmp_path: Path, loose_umask: object
) -> None:
    """The previous run's records move into prev/<N> 0700 and the chaos plan is written
    0600, whatever the umask (they were 0775 and 0664 under this one)."""
    run = tmp_path / "run"
    claim_run_dir(str(run), "job7")
    EventLog(str(run / "events.jsonl")).close()
    moved = claim_run_dir(str(run), "job7")
    assert moved == str(run / "prev" / "1")
    assert _mode(run / "prev") == 0o700 and _mode(run / "prev" / "1") == 0o700
    (run / "chaos").mkdir(mode=0o700)
    write_private(str(run / "chaos" / "plan.json"), "{}")
    assert _mode(run / "chaos" / "plan.json") == 0o600
    (run / "chaos" / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        write_private(str(run / "chaos" / "link"), "{}")
    assert not (tmp_path / "elsewhere").exists()


def test_an_existing_run_dir_of_ours_is_narrowed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    make_private_dir(str(run))
    assert _mode(run) == 0o700


@pytest.mark.parametrize("mode", [0o775, 0o777, 0o757])
def test_a_run_dir_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(mode)
    with pytest.raises(ConfigError) as err:
        claim_run_dir(str(run), "job7")
    text = str(err.value)
    assert "\n" not in text and "writable by other users" in text and "chmod 700" in text
    assert not (run / ".lock").exists()  # refused before writing anything


@_root_only
def test_a_run_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, OTHER_UID, -1)
    with pytest.raises(ConfigError) as err:
        claim_run_dir(str(run), "job7")
    assert f"belongs to uid {OTHER_UID}" in str(err.value)


def test_files_others_could_rewrite_are_distrusted(tmp_path: Path) -> None:
    f = tmp_path / "req.json"
    f.write_text("{}")
    f.chmod(0o600)
    assert owned_file(str(f)) is None
    f.chmod(0o620)
    assert "writable by other users" in str(owned_file(str(f)))
    link = tmp_path / "link.json"
    link.symlink_to(f)
    assert owned_file(str(link)) == "not a regular file"
    if os.geteuid() == 0:
        f.chmod(0o600)
        os.chown(f, OTHER_UID, -1)
        assert "owned by uid" in str(owned_file(str(f)))
