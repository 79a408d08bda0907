"""The outer step of --strategy async (runtime/replica_groups/_outer.py): LocalSGD's mean, DiLoCo's
Nesterov step, the outer state a rejoining group receives, and the parameter-set format."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from stalwart.runtime.replica_groups._outer import (
    OuterConfig,
    OuterOptimizer,
    ParamSetError,
    decode,
    encode,
)

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def test_localsgd_is_the_exact_mean() -> None:
    outer = OuterOptimizer(OuterConfig(lr=1.0, momentum=0.0))
    outer.begin(_params(0))
    a, b, c = _params(1), _params(2), _params(3)
    out = outer.step([a, b, c])
    for k in a:
        mean = ((a[k].double() + b[k].double() + c[k].double()) / 3).float()
        assert torch.equal(out[k], mean)
    assert outer.round == 1 and not outer.momentum


def test_diloco_is_nesterov_sgd_on_the_pseudo_gradient() -> None:
    """Three rounds equal torch.optim.SGD(nesterov=True) fed start - mean as gradient."""
    lr, m = 0.7, 0.9
    outer = OuterOptimizer(OuterConfig(lr=lr, momentum=m))
    start = _params(0)
    outer.begin(start)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=lr, momentum=m, nesterov=True)
    for r in range(3):
        groups = [_params(10 * r + i) for i in range(2)]
        out = outer.step(groups)
        for k, p in ref.items():
            p.grad = p.detach() - (groups[0][k] + groups[1][k]) / 2
        sgd.step()
        for k, p in ref.items():
            torch.testing.assert_close(out[k], p.detach(), rtol=1e-6, atol=1e-6)
    assert outer.round == 3


def test_the_outer_state_resumes_identically() -> None:
    """A rejoining group given the state dict computes the next round as the others."""
    a = OuterOptimizer(OuterConfig())
    a.begin(_params(0))
    a.step([_params(1), _params(2)])
    b = OuterOptimizer(OuterConfig())
    b.load_state_dict(a.state_dict())
    nxt = [_params(3), _params(4)]
    want, got = a.step(nxt), b.step(nxt)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_contribution_of_another_model_is_refused() -> None:
    outer = OuterOptimizer(OuterConfig())
    outer.begin(_params(0))
    with pytest.raises(ParamSetError, match="same model"):
        outer.step([{"w": torch.zeros(4, 3)}])
    with pytest.raises(ParamSetError, match="shape"):
        outer.step([{"w": torch.zeros(3, 4), "b": torch.zeros(3)}])


@pytest.mark.parametrize(("lr", "m"), [(0.0, 0.9), (float("nan"), 0.9), (0.7, 1.0), (0.7, -0.1)])
def test_bad_outer_settings_are_refused(lr: float, m: float) -> None:
    with pytest.raises(ParamSetError, match="--outer"):
        OuterConfig(lr=lr, momentum=m)


def test_parameter_sets_round_trip_every_float_dtype() -> None:
    params = {
        "a": torch.randn(2, 3),
        "b": torch.randn(5, dtype=torch.float64),
        "c": torch.randn(4, dtype=torch.bfloat16),
        "d": torch.randn(1, 2, 2, dtype=torch.float16),
    }
    back = decode(encode(params))
    assert list(back) == list(params)
    for k, v in params.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def test_malformed_parameter_sets_are_refused() -> None:
    blob = encode(_params(0))
    with pytest.raises(ParamSetError, match="trailing"):
        decode(blob + b"x")
    with pytest.raises(ParamSetError, match="overruns"):
        decode(blob[:-1])
    with pytest.raises(ParamSetError, match="shorter"):
        decode(b"ab")
    head = b'{"v": 2, "tensors": []}'
    with pytest.raises(ParamSetError, match="format 2"):
        decode(struct.pack(">I", len(head)) + head)
    head = b'{"v": 1, "tensors": [["w", "float32", [2], 9]]}'
    with pytest.raises(ParamSetError, match="malformed"):
        decode(struct.pack(">I", len(head)) + head + bytes(9))
    with pytest.raises(ParamSetError, match="float tensors"):
        encode({"i": torch.zeros(2, dtype=torch.int64)})


def test_the_outer_state_survives_a_checkpoint(tmp_path: Path, shm_namespace: str) -> None:
    """Tracked as ``_outer`` (runtime/replica_groups/_rejoin.py), the round's start
    parameters and the momentum are saved and restored with the rest: a group resumed
    from its checkpoint computes the next round as the group that wrote it."""
    from stalwart.checkpoint import CheckpointConfig, CheckpointManager

    a = OuterOptimizer(OuterConfig())
    a.begin(_params(0))
    a.step([_params(1), _params(2)])
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path / "ckpt"), namespace=shm_namespace))
    try:
        mgr.save({"_outer": a}, 10)
        b = OuterOptimizer(OuterConfig())
        b.begin(_params(7))  # the script's initial parameters: overwritten by the restore
        mgr.restore({"_outer": b}, step=10)
    finally:
        mgr.close()
    assert b.round == 1
    nxt = [_params(3), _params(4)]
    want, got = a.step(nxt), b.step(nxt)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert all(torch.equal(a.momentum[k], b.momentum[k]) for k in a.momentum)


def test_diloco_momentum_exists_from_the_start() -> None:
    """Zeros before the first round: the snapshot's layout is the same in every round
    (LocalSGD has none)."""
    d = OuterOptimizer(OuterConfig())
    d.begin(_params(0))
    assert set(d.momentum) == {"w", "b"} and all(not v.any() for v in d.momentum.values())
    s = OuterOptimizer(OuterConfig(lr=1.0, momentum=0.0))
    s.begin(_params(0))
    assert s.momentum == {}
