"""Crafted checkpoints whose checksums are valid: every `stalwart ckpt` verb answers in
one line with a non-zero exit, nothing outside the root is read or deleted, and restore
falls back to the previous good step and moves the bad one aside."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _models import make_state, params, train_step

from stalwart.checkpoint import CheckpointConfig, CheckpointManager, restore_state
from stalwart.checkpoint.format import checksum, index_path, manifest_path
from stalwart.checkpoint.storage import LocalStorage
from stalwart.cli.main import main
from stalwart.errors import CheckpointCorruptError

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


Edit = Callable[[dict[str, Any], dict[str, Any], Path], None]


@pytest.fixture
def saved(tmp_path: Path, shm_namespace: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A checkpoint with steps 1 (good) and 2 (to be crafted), and the params of step 1."""
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(CheckpointConfig(str(root), namespace=shm_namespace))
    try:
        state = make_state()
        mgr.save(state, 1)
        want = params(state)
        train_step(state)
        mgr.save(state, 2)
    finally:
        mgr.close()
    yield root, want


def _craft(root: Path, step: int, edit: Edit) -> None:
    """Apply ``edit(manifest_doc, index_doc, root)`` and re-checksum both files, so that
    only the validation of fields (not a checksum) can catch the change."""
    mdoc = json.loads((root / manifest_path(step)).read_bytes())
    idoc = json.loads((root / index_path(step, 0)).read_bytes())
    edit(mdoc, idoc, root)
    raw = json.dumps(idoc).encode()
    (root / index_path(step, 0)).write_bytes(raw)
    mdoc["indexes"][0].update(checksum=checksum(raw), nbytes=len(raw))
    del mdoc["checksum"]
    canon = json.dumps(mdoc, sort_keys=True, separators=(",", ":"))
    mdoc["checksum"] = checksum(canon.encode())
    (root / manifest_path(step)).write_text(json.dumps(mdoc))


def _chunk(i: int, value: Any) -> Edit:
    def edit(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
        idx["tensors"][0]["chunks"][0][i] = value

    return edit


def _tensor(key: str, value: Any) -> Edit:
    def edit(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
        idx["tensors"][0][key] = value

    return edit


def _manifest(key: str, value: Any) -> Edit:
    def edit(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
        m[key] = value

    return edit


def _index_path(value: Any) -> Edit:
    def edit(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
        m["indexes"][0]["path"] = value

    return edit


def _pack_is_dir(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
    pack = root / idx["tensors"][0]["chunks"][0][1]
    pack.unlink()
    pack.mkdir()


def _outside_pack(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
    (root.parent / "outside").mkdir()
    (root.parent / "outside" / "secret.bin").write_bytes(b"x" * 64)
    idx["tensors"][0]["chunks"][0][1] = "../outside/secret.bin"


def _tree_id(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
    idx["tree"] = {"t": "tensor", "id": 999}


def _self_copy(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
    t = idx["tensors"][0]
    t.update(
        chunks=[], copy_of=0, shard={"global_shape": t["shape"], "offsets": [0] * len(t["shape"])}
    )


def _huge_global_shape(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
    """A shard that claims to be a sliver of a 2^36-row tensor: export would allocate it."""
    t = idx["tensors"][0]
    glob = [1 << 36, *t["shape"][1:]] if t["shape"] else []
    t["shard"] = {"global_shape": glob, "offsets": [0] * len(t["shape"])}


def _claims_anothers_bytes(m: dict[str, Any], idx: dict[str, Any], root: Path) -> None:
    """A chunk moved onto the place of another tensor's chunk (same pack, its own length
    and hash): verify checked each place once and said ok of it."""
    first, second = [t["chunks"][0] for t in idx["tensors"] if t["chunks"]][:2]
    assert first[1] == second[1]  # one pack
    second[2] = first[2]


CASES: dict[str, Edit] = {
    "chunk length -5": _chunk(3, -5),
    "chunk length 2^50": _chunk(3, 1 << 50),
    "chunk offset -4096": _chunk(2, -4096),
    "pack outside the root": _outside_pack,
    "pack is a directory": _pack_is_dir,
    "created_unix 1e300": _manifest("created_unix", 1e300),
    "integer index path": _index_path(5),
    "absolute index path": _index_path("/etc/passwd"),
    "world_size 3, one index": _manifest("world_size", 3),
    "unknown dtype": _tensor("dtype", "float99"),
    "shape 2^48": _tensor("shape", [1 << 48]),
    "unknown tree id": _tree_id,
    "copy of itself": _self_copy,
    "chunk on another's bytes": _claims_anothers_bytes,
    "global shape 2^36 rows": _huge_global_shape,
}


_LAYOUT = ("copy of itself", "global shape 2^36 rows")  # found across the step's ranks


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_step_gets_one_line_and_restore_falls_back(
    case: str, saved: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, want = saved
    _craft(root, 2, CASES[case])
    for verb in (["verify"], ["inspect", "--step", "2"], ["ls"], ["export"]):
        extra = [str(root.parent / f"out-{verb[0]}")] if verb == ["export"] else []
        args = ["ckpt", verb[0], str(root), *extra, *verb[1:]]
        if verb == ["export"]:
            args += ["--step", "2"]
        rc, text = _cli(args, capsys)
        assert "Traceback" not in text, (verb, text)
        # inspect reads no chunk and one index: a pack or a step-wide layout is not its part
        lists_only = case in ("pack is a directory", "chunk on another's bytes", *_LAYOUT)
        if verb != ["ls"] and not (lists_only and verb[0] == "inspect"):
            assert rc != 0, (verb, case, text)
    storage = LocalStorage(str(root))
    state = make_state(seed=9)
    # into the same layout too: the step's layout is checked across every rank's index
    # before a byte is read, whether or not this rank reads another's pieces
    result = restore_state(storage, state, quarantine_damaged=True)
    assert result.step == 1 and result.skipped
    assert result.quarantined and result.quarantined[0].startswith("quarantine/step_000000000002")
    assert (root / result.quarantined[0]).is_dir()
    got = params(state)
    assert all((got[k] == want[k]).all() for k in want)


def test_linked_data_dir_is_refused_not_followed(
    saved: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = saved
    elsewhere = root.parent / "elsewhere"
    os.rename(root / "data", elsewhere)
    os.symlink(elsewhere, root / "data")
    rc, text = _cli(["ckpt", "verify", str(root)], capsys)
    assert rc != 0 and "symbolic link" in text and "Traceback" not in text
    with pytest.raises(CheckpointCorruptError, match="loads"):
        restore_state(LocalStorage(str(root)), make_state())


def _second_rank_overlapping(root: Path, step: int) -> None:
    """Make ``step`` a two-rank step whose rank 0 is intact (its piece: the top half of a
    tensor twice its rows) and whose rank 1 claims a box overlapping rank 0's."""
    mdoc = json.loads((root / manifest_path(step)).read_bytes())
    idx0 = json.loads((root / index_path(step, 0)).read_bytes())
    t = next(t for t in idx0["tensors"] if len(t["shape"]) == 2 and t["shape"][0] >= 2)
    rows = t["shape"][0]
    t["shard"] = {"global_shape": [2 * rows, t["shape"][1]], "offsets": [0, 0]}
    idx0["world_size"] = 2
    idx1 = copy.deepcopy(idx0)
    idx1["rank"] = 1
    t1 = next(x for x in idx1["tensors"] if x["id"] == t["id"])
    t1["shard"]["offsets"] = [rows // 2, 0]  # rows/2 .. rows overlap rank 0's piece
    mdoc["world_size"] = 2
    mdoc["indexes"].append(dict(mdoc["indexes"][0], rank=1, path=index_path(step, 1)))
    for rank, doc in ((0, idx0), (1, idx1)):
        raw = json.dumps(doc).encode()
        (root / index_path(step, rank)).write_bytes(raw)
        mdoc["indexes"][rank].update(checksum=checksum(raw), nbytes=len(raw))
    del mdoc["checksum"]
    canon = json.dumps(mdoc, sort_keys=True, separators=(",", ":"))
    mdoc["checksum"] = checksum(canon.encode())
    (root / manifest_path(step)).write_text(json.dumps(mdoc))


def test_a_same_layout_restore_checks_the_other_ranks_boxes(
    saved: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 restores into its own layout and reads only its own piece, which is intact;
    rank 1's box overlaps it. Every rank must reach the same verdict on the step (else
    rank 0 resumes from it and rank 1 from an older one): rank 0 skips it too."""
    root, want = saved
    _second_rank_overlapping(root, 2)
    rc, text = _cli(["ckpt", "verify", str(root), "--step", "2"], capsys)
    assert rc != 0 and "overlap" in text, text
    for rank in (0, 1):
        state = make_state(seed=9)
        result = restore_state(LocalStorage(str(root)), state, rank=rank, world_size=2)
        assert result.step == 1 and "overlap" in result.skipped[0], result.skipped
        got = params(state)
        assert all((got[k] == want[k]).all() for k in want)
