"""A torchtitan-style FSDP2 pretraining loop, ported to stalwart.

Written in the style of the FSDP2 trainers people run (not copied from one): a small
Llama-like decoder (RMSNorm, rotary-free attention, SwiGLU feed-forward, untied head),
every block and then the root wrapped with ``fully_shard``, AdamW, a ``LambdaLR`` with
linear warmup and cosine decay, ``clip_grad_norm_`` over the sharded (DTensor) gradients,
and a deterministic token stream per (step, rank). The stalwart change beyond the five
lines: ``fully_shard(..., mesh=sess.mesh)`` (a mesh whose process group is re-formed
under the same FSDP modules after a failure). At the end every rank gathers the full
parameters (a collective) and records their digest.

With ``--plain`` it is the unported script, for torchrun: ``init_process_group``,
``fully_shard`` over the default mesh, and torchtitan's own way to survive a restart: a
DCP checkpoint (model, optimizer, scheduler, step) every ``--checkpoint_interval`` steps
under ``--out``, loaded at start-up when one exists (bench/recovery.py measures its
recovery under torchrun beside the ported script's under stalwart).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _record import Recorder
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import stalwart


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.n_heads = n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(B, T, C))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_heads, 2 * dim) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tokens_for(step: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """The stream's batch for (step, rank): an arithmetic pattern with noise."""
    g = torch.Generator().manual_seed(7_919 * step + 104_729 * rank)
    start = torch.randint(vocab, (batch, 1), generator=g)
    seqs = (start + 3 * torch.arange(seq + 1)) % vocab
    noise = torch.rand(batch, seq + 1, generator=g) < 0.1
    return torch.where(noise, torch.randint(vocab, (batch, seq + 1), generator=g), seqs)


def linear_warmup_cosine(warmup: int, total: int):  # type: ignore[no-untyped-def]
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="folder for the trace and final digests")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--n_layers", type=int, default=2)
    p.add_argument("--n_heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup_steps", type=int, default=3)
    p.add_argument("--max_norm", type=float, default=1.0)
    p.add_argument("--plain", action="store_true", help="the unported torchrun script")
    p.add_argument("--checkpoint_interval", type=int, default=10, help="--plain: DCP saves")
    a = p.parse_args()
    if a.plain:
        plain(a)
        return

    sess = stalwart.init()  # stalwart
    torch.manual_seed(0)
    model = Transformer(a.vocab, a.dim, a.n_layers, a.n_heads)
    for layer in model.layers:
        fully_shard(layer, mesh=sess.mesh)  # stalwart: mesh=sess.mesh
    fully_shard(model, mesh=sess.mesh)  # stalwart: mesh=sess.mesh
    optimizer, scheduler = optimizer_and_scheduler(model, a)
    sess.track(model=model, optimizer=optimizer, lr_scheduler=scheduler)  # stalwart

    rec = Recorder(a.out, sess.env.rank)
    for step in sess.steps(a.steps):  # stalwart
        loss, norm = train_step(model, optimizer, scheduler, step, sess.rank, a)
        sess.log(loss=loss)  # stalwart
        if sess.step_ok:
            rec.step(
                step,
                generation=sess.generation,
                rank=sess.rank,
                world=sess.world_size,
                loss=loss.item(),
                samples=[step * 1000 + sess.rank],
                grad_norm=norm(),
            )
        if sess.rank == 0 and step % 8 == 0:
            print(
                f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                flush=True,
            )
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective
    if not sess.step_ok:
        raise SystemExit("a peer failed while gathering the final parameters; not saved")
    rec.final(full, step=a.steps, world=sess.world_size)
    sess.close()  # stalwart


def optimizer_and_scheduler(
    model: nn.Module, a: argparse.Namespace
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, linear_warmup_cosine(a.warmup_steps, a.steps)
    )
    return optimizer, scheduler


def train_step(  # type: ignore[no-untyped-def]
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    step: int,
    rank: int,
    a: argparse.Namespace,
):
    """One step; returns the loss and a function giving the gradient norm as a float."""
    tokens = tokens_for(step, rank, a.batch, a.seq, a.vocab)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer.zero_grad()
    pred = model(inputs)
    loss = F.cross_entropy(pred.reshape(-1, a.vocab), labels.reshape(-1))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_norm, foreach=True)
    optimizer.step()
    scheduler.step()

    def norm() -> float:
        full = getattr(grad_norm, "full_tensor", None)
        return float(full()) if full is not None else float(grad_norm)

    return loss, norm


def plain(a: argparse.Namespace) -> None:
    """The unported loop under torchrun, with torchtitan's checkpoint/resume."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Transformer(a.vocab, a.dim, a.n_layers, a.n_heads)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer, scheduler = optimizer_and_scheduler(model, a)
    ckpt_dir, start = os.path.join(a.out, "checkpoint"), 1
    # complete checkpoints only: DCP writes .metadata last (a kill mid-save leaves none)
    done = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    latest = sorted(
        int(d.split("-")[1])
        for d in done
        if d.startswith("step-") and os.path.exists(os.path.join(ckpt_dir, d, ".metadata"))
    )
    if latest:  # resume like torchtitan: model, optimizer, scheduler and step from DCP
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "lr_scheduler": scheduler.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, f"step-{latest[-1]}"))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        scheduler.load_state_dict(state["lr_scheduler"])
        start = latest[-1] + 1
    rec = Recorder(a.out, rank)
    for step in range(start, a.steps + 1):
        loss, norm = train_step(model, optimizer, scheduler, step, rank, a)
        rec.step(
            step,
            generation=0,
            rank=rank,
            world=dist.get_world_size(),
            loss=loss.item(),
            samples=[step * 1000 + rank],
            grad_norm=norm(),
        )
        if step % a.checkpoint_interval == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "lr_scheduler": scheduler.state_dict()}
            dcp.save(state, checkpoint_id=os.path.join(ckpt_dir, f"step-{step}"))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    rec.final(full, step=a.steps, world=dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
