"""`--strategy restart --persist-every N`: every rank gets its own RNG and tracked values
back from disk, so a run with a kill ends bit-identical to a fault-free one even when
the ranks sample their batches with the global RNG (``torch.randint``) seeded per rank."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from ._launch import events_of, stalwart_run

SCRIPT = textwrap.dedent(
    """
    import random, sys
    import numpy as np
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import stalwart

    sess = stalwart.init()
    torch.manual_seed(0)
    data = torch.randn(512, 9)
    nn = torch.nn
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.97**e)  # before track()
    torch.manual_seed(1337 + sess.rank)  # per-rank seeds, as nanoGPT does
    random.seed(1337 + sess.rank)
    np.random.seed(1337 + sess.rank)
    meta = {"seen": 0, "best": 1e9}
    sess.track(model=model, optimizer=opt, scheduler=sched, meta=meta)
    for step in sess.steps(int(sys.argv[2])):
        ix = torch.randint(len(data), (16,))
        scale = 1.0 + 1e-3 * random.random() + 1e-3 * float(np.random.rand())
        x, y = data[ix, :8] * scale, data[ix, 8:]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        meta["seen"] += int(ix.sum())
        meta["best"] = min(meta["best"], loss.item())
    out = {k: v for k, v in model.module.state_dict().items()}
    out["seen"] = torch.tensor(meta["seen"])
    out["best"] = torch.tensor(meta["best"])
    out["next"] = torch.randint(1 << 30, (4,))
    torch.save(out, f"{sys.argv[1]}.rank{sess.rank}")
    sess.close()
    """
)


def _run(tmp_path: Path, name: str, extra: list[str]) -> list[dict[str, torch.Tensor]]:
    script = tmp_path / "train_randint.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{name}.pt"
    proc = stalwart_run(
        tmp_path / name,
        ["--nproc-per-node", "2", *extra, str(script), str(out), "30"],
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)]


@pytest.mark.timeout(330)
def test_restart_from_disk_gives_every_rank_its_own_rng_and_values(tmp_path: Path) -> None:
    ref = _run(tmp_path, "ref", [])
    assert not torch.equal(ref[0]["next"], ref[1]["next"])  # the ranks draw apart
    restart = [
        "--strategy",
        "restart",
        "--max-restarts",
        "1",
        "--persist-every",
        "3",
        "--chaos",
        "kill rank=1 at=step:22",
    ]
    got = _run(tmp_path, "restart", restart)
    for rank in (0, 1):
        assert ref[rank].keys() == got[rank].keys()
        for key, tensor in ref[rank].items():
            assert torch.equal(tensor, got[rank][key]), (rank, key)
    # the restart happened (from whichever step had been committed: not asserted)
    events = events_of(tmp_path / "restart")
    assert [f["strategy"] for k, f in events if k == "recovery_begin"] == ["restart"]
