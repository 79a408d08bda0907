"""checkpoint/_stale.py: the owner record of a run's /dev/shm names and the startup sweep
that removes what this user's dead runs left, and nothing of a live run or another user."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stalwart.checkpoint.slots import run_owner, sweep_stale
from stalwart.contract.shm_names import SlotNames, new_run_id


def _leftovers(names: SlotNames) -> list[str]:
    """What a run leaves: a rank's slot directory with a slot, a board, a journal."""
    os.makedirs(names.rank_dir(0), mode=0o700)
    Path(names.rank_dir(0), "slot-0").write_bytes(b"x" * 64)
    Path(names.progress_board(0)).write_bytes(b"b")
    Path(names.step_journal(7)).write_bytes(b"j")
    return [names.rank_dir(0), names.progress_board(0), names.step_journal(7)]


def _dead_record(names: SlotNames, **change: object) -> str:
    """An owner record of a process that is gone: this pid, another start time (what a
    reused pid looks like), or what ``change`` says."""
    run_owner(names).write()
    path = run_owner(names).path
    doc = json.loads(Path(path).read_text())
    doc["start"] = int(doc["start"]) + 12345
    doc.update(change)
    Path(path).write_text(json.dumps(doc))
    return path


def _names(tmp: Path, job: str = "job") -> SlotNames:
    return SlotNames(job, new_run_id(), str(tmp))


def test_a_dead_runs_names_are_removed_with_its_record(tmp_path: Path) -> None:
    dead = _names(tmp_path)
    left = _leftovers(dead)
    record = _dead_record(dead)
    removed = sweep_stale(str(tmp_path))
    assert sorted(removed) == sorted([*left, record])
    assert removed[-1] == record  # the record goes last
    assert os.listdir(tmp_path) == []


def test_a_live_runs_names_stay(tmp_path: Path) -> None:
    live = _names(tmp_path)
    left = _leftovers(live)
    run_owner(live).write()  # this process: alive
    assert sweep_stale(str(tmp_path)) == []
    assert all(os.path.exists(p) for p in [*left, run_owner(live).path])
    run_owner(live).remove()
    assert not os.path.exists(run_owner(live).path)


def test_one_live_owner_of_a_run_keeps_it(tmp_path: Path) -> None:
    """Two nodes of one run on this host (or a replacement agent restoring from the
    slots of the one that died): one dead owner does not make the run dead."""
    run = _names(tmp_path)
    left = _leftovers(run)
    dead_pid = os.getpid() + 1
    other = tmp_path / f"stalwart-{run.job}-{run.run}-owner-{dead_pid}"
    doc = {"v": 1, "stem": f"{run.job}-{run.run}", "pid": dead_pid, "start": 1, "boot": "x"}
    other.write_text(json.dumps(doc))
    run_owner(run).write()
    assert sweep_stale(str(tmp_path)) == []
    assert all(os.path.exists(p) for p in left) and other.exists()


def test_names_of_no_recorded_run_stay(tmp_path: Path) -> None:
    """torchrun or plain python (no agent, no record), an older stalwart: not judged."""
    plain = SlotNames("plainjob", "", str(tmp_path))
    left = _leftovers(plain)
    assert sweep_stale(str(tmp_path)) == []
    assert all(os.path.exists(p) for p in left)


def test_each_name_belongs_to_the_longest_recorded_run(tmp_path: Path) -> None:
    """Job ``a``'s run dead, job ``a-<run>-x``'s alive: the second's names start with the
    first's stem and stay."""
    short = _names(tmp_path, "a")
    longer = SlotNames(f"a-{short.run}-x", new_run_id(), str(tmp_path))
    mine = _leftovers(short)
    theirs = _leftovers(longer)
    _dead_record(short)
    run_owner(longer).write()
    sweep_stale(str(tmp_path))
    assert not any(os.path.exists(p) for p in mine)
    assert all(os.path.exists(p) for p in theirs)


@pytest.mark.parametrize(
    "change",
    [{"pidns": "pid:[1]"}, {"v": 99}, {"stem": "someone-else"}, {"start": None}],
    ids=["other-pid-namespace", "unknown-version", "stem-not-its-name", "no-start-time"],
)
def test_an_owner_that_cannot_be_judged_keeps_the_run(tmp_path: Path, change: object) -> None:
    run = _names(tmp_path)
    left = _leftovers(run)
    assert isinstance(change, dict)
    _dead_record(run, **change)
    assert sweep_stale(str(tmp_path)) == []
    assert all(os.path.exists(p) for p in left)


def test_an_unreadable_record_keeps_the_run(tmp_path: Path) -> None:
    run = _names(tmp_path)
    left = _leftovers(run)
    Path(run_owner(run).path).write_text("{not json")
    assert sweep_stale(str(tmp_path)) == []
    assert all(os.path.exists(p) for p in left)


def test_a_record_from_before_a_reboot_is_dead(tmp_path: Path) -> None:
    run = _names(tmp_path)
    _leftovers(run)
    _dead_record(run, start=None, boot="an-earlier-boot")
    assert len(sweep_stale(str(tmp_path))) == 4
    assert os.listdir(tmp_path) == []


def test_another_users_entries_and_records_are_never_touched(tmp_path: Path) -> None:
    """Their names under our dead run's stem stay; their dead record makes nothing of
    theirs go (a real other uid: entries are chown'ed to it)."""
    if os.getuid() != 0:
        pytest.skip("planting another user's entries needs root")
    dead = _names(tmp_path)
    left = _leftovers(dead)
    _dead_record(dead)
    theirs = tmp_path / f"stalwart-{dead.job}-{dead.run}-r5"
    theirs.mkdir()
    other_run = _names(tmp_path, "victim")
    victim = _leftovers(other_run)
    their_record = _dead_record(other_run)
    for p in [str(theirs), *victim, their_record]:
        os.chown(p, 65534, -1)
    removed = sweep_stale(str(tmp_path))
    assert not any(os.path.exists(p) for p in left)
    assert theirs.exists() and str(theirs) not in removed
    assert all(os.path.exists(p) for p in [*victim, their_record])


def _record_of(names: SlotNames, pid: int) -> Path:
    """An owner record of this run naming process ``pid`` as it is now."""
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    start = int(raw[raw.rfind(b")") + 2 :].split()[19])
    run_owner(names).write()
    doc = json.loads(Path(run_owner(names).path).read_text())
    run_owner(names).remove()
    doc.update(pid=pid, start=start)
    path = Path(names.shm_dir) / f"stalwart-{names.stem}-owner-{pid}"
    path.write_text(json.dumps(doc))
    return path


def test_another_live_owner_of_the_run_on_this_host_is_seen(tmp_path: Path) -> None:
    """What a fenced agent asks before it removes its ranks' slots: another agent of its
    run on this host may have adopted them (agent/_lifecycle.py ``clean_shm``)."""
    run, other_run = _names(tmp_path), _names(tmp_path)
    run_owner(run).write()
    assert not run_owner(run).others_alive()  # its own record is not another's
    _record_of(other_run, os.getppid())
    assert not run_owner(run).others_alive()  # another run's owner does not count
    dead = _record_of(run, os.getppid())
    doc = json.loads(dead.read_text())
    dead.write_text(json.dumps({**doc, "start": doc["start"] + 1}))  # its pid reused
    assert not run_owner(run).others_alive()
    _record_of(run, os.getppid())
    assert run_owner(run).others_alive()
