"""FSDP2 x tensor parallel on CPU over gloo: a ("dp", "tp") mesh of 2 x 2 under stalwart.

Each MLP's ``up`` is split by columns and ``down`` by rows over the ``tp`` dimension
(DTensor ``Shard`` placements), then sharded with FSDP2 over ``dp``. The stalwart lines
are marked; the one TP-specific change is ``src_data_rank=None``: parallelize_module
scatters rank 0's weights by default, a collective before the job's group forms (members
connect at the first step), which stalwart refuses; with it every rank, seeded alike,
keeps its own copy. Every rank also trains a plain single-process copy of the model on
the whole global batch and prints the largest difference of its forward pass and of the
parameters after ``--steps`` SGD steps (float rounding only: about 1e-7).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import stalwart  # stalwart


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def batches(step: int, dp_size: int, dim: int) -> list[torch.Tensor]:
    return [
        torch.randn(8, dim, generator=torch.Generator().manual_seed(step * 7 + d))
        for d in range(dp_size)
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dim", type=int, default=32)
    args = p.parse_args()
    sess = stalwart.init()  # stalwart
    mesh = sess.init_device_mesh((sess.world_size // 2, 2), ("dp", "tp"))  # stalwart
    torch.manual_seed(0)
    model = nn.Sequential(MLP(args.dim), MLP(args.dim))
    ref = copy.deepcopy(model)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for m in model:
        parallelize_module(m, mesh["tp"], plan, src_data_rank=None)  # stalwart: no scatter
        fully_shard(m, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sess.track(model=model, optimizer=opt)  # stalwart
    dp, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
    forward_err = 0.0
    for step in sess.steps(args.steps):  # stalwart
        xs = batches(step, dp_size, args.dim)
        out = model(xs[dp])
        forward_err = max(forward_err, float((out - ref(xs[dp])).abs().max()))
        loss = F.mse_loss(out, torch.sin(xs[dp]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = sum(F.mse_loss(ref(x), torch.sin(x)) for x in xs) / dp_size
        ref_opt.zero_grad()
        ref_loss.backward()  # type: ignore[union-attr]
        ref_opt.step()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    err = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
    print(
        f"rank {sess.rank}: forward max err {forward_err:.3g} params max err {err:.3g}", flush=True
    )
    sess.close()


if __name__ == "__main__":
    main()
