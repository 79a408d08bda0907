"""DCP interop: export -> plain torch load is bit-exact; import -> restore equals; errors."""

from __future__ import annotations

import inspect
import io
import os
import pickle
import subprocess
import sys
import textwrap
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _load import scaled
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from stalwart.checkpoint import CheckpointConfig, CheckpointManager
from stalwart.checkpoint._load import byte_view
from stalwart.checkpoint._tree import flatten
from stalwart.checkpoint._writer import publish_step, write_rank
from stalwart.checkpoint.dcp import export_dcp, import_dcp
from stalwart.checkpoint.storage import open_storage
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    StateMismatchError,
)

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


def build() -> nn.Sequential:
    """The model; its source also runs in the torch-only subprocess."""
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def trained(steps: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(7)
    for _ in range(steps):
        model(torch.randn(6, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save(root: Path, state: dict[str, Any], *steps: int) -> None:
    mgr = CheckpointManager(CheckpointConfig(root=str(root), namespace=f"t-dcp-{uuid.uuid4().hex}"))
    try:
        for s in steps:
            mgr.save(state, s)
    finally:
        mgr.close()


def restore(root: Path, state: dict[str, Any]) -> int:
    cfg = CheckpointConfig(root=str(root), namespace=f"t-dcp-{uuid.uuid4().hex}")
    mgr = CheckpointManager(cfg)
    try:
        return mgr.restore(state).step
    finally:
        mgr.close()


def bits(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    flat = t.detach().contiguous().reshape(-1)
    return t.dtype, tuple(t.shape), flat.view(torch.uint8).numpy().tobytes()


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert bits(a) == bits(b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def dcp_write(state: dict[str, Any], out: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save(state, checkpoint_id=str(out), no_dist=True)


# -- the torch-only consumer ------------------------------------------------------------
PLAIN_LOAD = """
def main(ckpt, result):
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    # an un-stepped optimizer has no state tensors for DCP to load into: create them
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, result)
    assert sys.modules["stalwart"] is None  # never imported (it would have failed)
    assert not [m for m in sys.modules if m.startswith("stalwart.")]
"""


def test_export_loads_with_plain_torch_bit_exact(tmp_path: Path) -> None:
    model, opt = trained(steps=2)
    save(tmp_path / "ck", {"model": model, "optimizer": opt}, 5)
    report = export_dcp(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert report.step == 5 and report.skipped == [] and report.chunks_verified > 0
    assert report.tensors == len(model.state_dict()) + 3 * len(list(model.parameters()))
    assert "exported step 5" in report.summary() and report.to_json()["tensors"] == report.tensors
    assert sorted(os.listdir(tmp_path)) == ["ck", "out"]  # no temp directory left over

    code = "\n".join(
        [
            "import sys; sys.modules['stalwart'] = None  # importing stalwart now fails",
            "import warnings; warnings.simplefilter('ignore')",
            "import torch; from torch import nn; import torch.distributed.checkpoint as dcp",
            inspect.getsource(build),
            textwrap.dedent(PLAIN_LOAD),
            "main(sys.argv[1], sys.argv[2])",
        ]
    )
    result = tmp_path / "loaded.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, str(tmp_path / "out"), str(result)],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(90),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = torch.load(result, weights_only=True)
    assert_same(model.state_dict(), loaded["model"], "model")
    assert_same(opt.state_dict(), loaded["optimizer"], "optimizer")


def test_import_then_restore_equals(tmp_path: Path) -> None:
    model, opt = trained()
    extra = {"epoch": 3, "betas": (0.9, 0.99), "hist": [torch.arange(3), 4.5]}
    dcp_write(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": extra},
        tmp_path / "dcp",
    )
    report = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"), step=40)
    assert report.names == ["extra", "model", "optimizer"] and report.skipped == []
    assert "as step 40" in report.summary()

    model2 = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    got: dict[str, Any] = {}
    assert restore(tmp_path / "ck", {"model": model2, "optimizer": opt2, "extra": got}) == 40
    assert_same(model.state_dict(), model2.state_dict(), "model")
    assert_same(opt.state_dict(), opt2.state_dict(), "optimizer")
    assert_same(extra, got, "extra")


class FqnOptimizer:
    """An optimizer seen through parameter names, as torchtitan saves it (docs/interop.md)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.opt, sd)


def test_import_torchtitan_layout(tmp_path: Path) -> None:
    """Model weights flat at the top, an FQN-keyed optimizer, an io.BytesIO in train_state."""
    model, opt = trained()
    state = {
        **get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, opt),
        "train_state": {"step": torch.tensor(9), "losses": io.BytesIO(b"xx")},
    }
    dcp_write(state, tmp_path / "dcp")

    only = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"), include=["model"])
    assert only.names == ["model"] and only.step == 0 and only.skipped == []
    model2 = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    restore(tmp_path / "ck", {"model": model2})
    assert_same(model.state_dict(), model2.state_dict())

    full = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck2"), step=9)
    assert full.names == ["model", "optimizer", "train_state"]
    assert full.notes == [f"{len(model.state_dict())} top-level tensors grouped under 'model'"]
    assert len(full.skipped) == 1 and full.skipped[0].startswith("train_state.losses: ")
    assert "weights_only" in full.skipped[0]
    model3 = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt3 = torch.optim.Adam(model3.parameters(), lr=0.5)
    train_state: dict[str, Any] = {}
    target = {"model": model3, "optimizer": FqnOptimizer(model3, opt3), "train_state": train_state}
    restore(tmp_path / "ck2", target)
    assert_same(opt.state_dict(), opt3.state_dict())
    assert_same(train_state, {"step": torch.tensor(9)})


def test_round_trip_of_an_unstepped_optimizer(tmp_path: Path) -> None:
    """DCP drops empty dicts (an un-stepped optimizer's state); import puts it back."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    save(tmp_path / "ck", {"model": model, "optimizer": opt}, 2)
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
    import_dcp(str(tmp_path / "dcp"), str(tmp_path / "back"), step=2)
    model2 = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5)
    restore(tmp_path / "back", {"model": model2, "optimizer": opt2})
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())


def test_export_falls_back_past_a_corrupt_step(tmp_path: Path) -> None:
    model, opt = trained()
    root = tmp_path / "ck"
    save(root, {"model": model, "optimizer": opt}, 1)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(6, 8)).sum().backward()
    opt.step()
    save(root, {"model": model, "optimizer": opt}, 2)
    pack = next(p for p in (root / "data").iterdir() if p.name.startswith("000000000002-"))
    raw = bytearray(pack.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))

    with pytest.raises(CheckpointCorruptError):
        export_dcp(str(root), str(tmp_path / "bad"), step=2)
    assert not (tmp_path / "bad").exists()
    report = export_dcp(str(root), str(tmp_path / "out"))
    assert report.step == 1 and report.skipped and "checksum" in report.skipped[0]
    sd = {"model": {k: torch.empty_like(v) for k, v in ref.items()}}
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert_same(ref, sd["model"])


def _write_sharded(root: Path, boxes: list[tuple[int, int]]) -> torch.Tensor:
    """A checkpoint whose rank r saved rows boxes[r] of a DTensor-like [6, 3] weight."""
    full = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    storage = open_storage(str(root))
    for rank, (lo, hi) in enumerate(boxes):
        tree, leaves = flatten({"model": {"w": full[lo:hi].clone(), "b": torch.ones(2)}})
        buf = torch.cat([leaf.tensor.reshape(-1).view(torch.uint8) for leaf in leaves])
        layout, pos = [], 0
        for i, leaf in enumerate(leaves):
            shard = {"global_shape": [6, 3], "offsets": [lo, 0]} if i == 0 else None
            n = leaf.tensor.nbytes
            layout.append(
                {
                    "id": i,
                    "path": leaf.path,
                    "dtype": "float32",
                    "shape": list(leaf.tensor.shape),
                    "nbytes": n,
                    "offset": pos,
                    "shard": shard,
                }
            )
            pos += n
        write_rank(
            storage,
            step=3,
            rank=rank,
            world_size=len(boxes),
            tree=tree,
            layout=layout,
            data=byte_view(buf),
            known={},
        )
    publish_step(storage, 3, len(boxes))
    return full


def test_export_assembles_dtensor_shards(tmp_path: Path) -> None:
    # 4 ranks: rows split in 2, each half replicated twice (HSDP-like)
    full = _write_sharded(tmp_path / "ck", [(0, 3), (3, 6), (0, 3), (3, 6)])
    report = export_dcp(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert report.assembled == 1 and report.world_size == 4
    assert report.notes == [
        "4 ranks, DTensor shards assembled; other values rank 0's were exported "
        "(per-rank values of other ranks, e.g. RNG states, are not in the output)"
    ]
    sd = {"model": {"w": torch.zeros(6, 3), "b": torch.zeros(2)}}
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert_same(full, sd["model"]["w"])

    _write_sharded(tmp_path / "gap", [(0, 2), (3, 6)])  # rows 2..3 saved by nobody
    with pytest.raises(CheckpointCorruptError, match="missing ranks"):
        export_dcp(str(tmp_path / "gap"), str(tmp_path / "out2"))


class _Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo pwned",))


@pytest.fixture
def stalwart_ckpt(tmp_path: Path) -> Iterator[Path]:
    save(tmp_path / "ck", {"x": torch.ones(3)}, 1)
    yield tmp_path / "ck"


def test_errors(tmp_path: Path, stalwart_ckpt: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        export_dcp(missing, str(tmp_path / "o1"))
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        import_dcp(missing, str(tmp_path / "o1"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointFormatError, match="not a DCP checkpoint"):
        import_dcp(str(tmp_path / "empty"), str(tmp_path / "o1"))
    with pytest.raises(CheckpointFormatError, match="stalwart checkpoint"):
        import_dcp(str(stalwart_ckpt), str(tmp_path / "o1"))
    with pytest.raises(CheckpointNotFoundError, match="no committed step 7"):
        export_dcp(str(stalwart_ckpt), str(tmp_path / "o1"), step=7)
    with pytest.raises(ConfigError, match="not an empty directory"):
        export_dcp(str(stalwart_ckpt), str(stalwart_ckpt))
    save(tmp_path / "run" / "ckpt", {"x": torch.ones(3)}, 1)
    with pytest.raises(CheckpointNotFoundError, match=r"a run directory.*/run/ckpt: pass that"):
        export_dcp(str(tmp_path / "run"), str(tmp_path / "o1"))

    dcp_write({"model": {"w": torch.ones(2)}}, tmp_path / "dcp")
    with pytest.raises(CheckpointFormatError, match="DCP checkpoint, not a stalwart one"):
        export_dcp(str(tmp_path / "dcp"), str(tmp_path / "o1"))
    with pytest.raises(ConfigError, match="not empty"):
        import_dcp(str(tmp_path / "dcp"), str(stalwart_ckpt))
    with pytest.raises(ConfigError, match="no top-level name"):
        import_dcp(str(tmp_path / "dcp"), str(tmp_path / "o1"), include=["optimizer"])
    assert not (tmp_path / "o1").exists()

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointFormatError, match=r"refusing posix\.system"):
        import_dcp(str(evil), str(tmp_path / "o2"))


class _DDPLike(nn.Module):
    """What DistributedDataParallel's state_dict looks like: the model under ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_export_of_a_ddp_model_loads_into_the_plain_model(tmp_path: Path) -> None:
    model, opt = trained(steps=2)
    wrapped = _DDPLike(model)
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    save(tmp_path / "ck", {"model": wrapped, "optimizer": opt}, 3)
    report = export_dcp(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert any("'module.' prefix removed" in n for n in report.notes)
    plain = build()  # the docs/interop.md recipe, unchanged
    sd = {"model": plain.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.distributed.checkpoint.load(sd, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    plain.load_state_dict(sd["model"])
    assert_same(model.state_dict(), plain.state_dict(), "model")


def test_cli_import_include(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stalwart.cli.main import main

    model, opt = trained()
    dcp_write({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "dcp")
    src, out = str(tmp_path / "dcp"), str(tmp_path / "ck")
    assert main(["ckpt", "import", src, out, "--include", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no top-level name(s) nope" in err
    assert main(["ckpt", "import", src, out, "--include", "model", "--step", "4"]) == 0
    assert "as step 4: model;" in capsys.readouterr().out
    model2 = build()
    assert restore(tmp_path / "ck", {"model": model2}) == 4
    assert_same(model.state_dict(), model2.state_dict())


def test_import_resumes_a_run_that_tracks_rngs_and_a_ddp_wrapper(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What `stalwart run` tracks: the DDP wrapper (keys `module.*`) and its own `_rng`;
    a DCP checkpoint of the plain model has neither, and still resumes."""
    from stalwart.checkpoint import RNGState

    model, opt = trained()
    dcp_write({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "dcp")
    import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"), step=3)
    wrapped = _DDPLike(build())
    opt2 = torch.optim.Adam(wrapped.parameters(), lr=0.5)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    with caplog.at_level("WARNING", logger="stalwart"):
        state = {"model": wrapped, "optimizer": opt2, "_rng": RNGState()}
        assert restore(tmp_path / "ck", state) == 3
    assert_same(model.state_dict(), wrapped.module.state_dict(), "model")
    assert_same(opt.state_dict(), opt2.state_dict(), "optimizer")
    assert torch.equal(torch.get_rng_state(), before)  # left as the process seeded it
    assert [r.getMessage()[:40] for r in caplog.records if r.name.startswith("stalwart")] == [
        "the checkpoint holds no RNG state (_rng)"
    ]
    with pytest.raises(StateMismatchError, match="missing in checkpoint: sched"):
        restore(tmp_path / "ck", {**state, "sched": {}})
