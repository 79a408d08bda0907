"""A nanoGPT-style character LM trainer, ported to stalwart with the README's five lines.

Written in the style of the single-file GPT trainers people run (not copied from one): a
config of module-level defaults overridden from the command line, ``1337 + rank`` seeded
before the model is built (DDP's constructor is trusted to make the replicas agree),
batches drawn with ``torch.randint`` from the global RNG, gradient accumulation through
``model.require_backward_grad_sync``, gradient clipping, the learning rate set by hand
every iteration (warmup, cosine decay), an evaluation on rank 0 only every
``eval_interval`` iterations (``estimate_loss()``: ``eval_iters`` forward passes on each
split, the other ranks wait in their next allreduce), and its own ``torch.save`` of a
checkpoint on rank 0 when the val loss improves (every eval with
``--always_save_checkpoint``), and nanoGPT's ``--init_from resume``: a (re)started plain
run loads ``ckpt.pt`` (model, optimizer, ``iter_num``) and goes on from there, which is the
classic route ``stalwart compare`` runs under ``torchrun --max-restarts`` (the RNG is not
saved, as in nanoGPT: the resumed run draws other batches).

The five stalwart lines are marked ``# stalwart``; ``--plain`` skips them and runs the
same script as a plain torchrun DDP script (``torchrun --nproc-per-node 2 nanogpt.py
--plain``). ``--data epoch --schedule cosine`` is the variant for ``--strategy elastic``:
the samples come from ``stalwart.data.loader`` (re-partitioned on a resize, each sample
once per epoch) with a constant global batch, and the LR from a tracked ``LambdaLR``.
``--torchft`` is the same script ported to torchft the way its README's train_ddp.py does
it (one replica group of one worker per ``REPLICA_GROUP_ID``, each under its own
``torchrun --max-restarts``, a lighthouse at ``TORCHFT_LIGHTHOUSE``): a ``Manager`` whose
``state_dict``/``load_state_dict`` heal a restarted group from a live one, torchft's
Optimizer wrapper (``zero_grad`` at the top of the loop starts the quorum, ``step``
commits only if every participant's allreduce succeeded), the gradients averaged by one
``manager.allreduce`` of them flattened after the accumulation, and the loop driven by
``manager.current_step()``; stalwart's ``compare`` runs it as its torchft route. Not
torchft's DDP wrapper: in torchft 0.2.0 its comm hook fails an assertion (``assert
fut._fut``) when the manager errored before the allreduce, so every survivor of a peer's
death crashed, and with no live group left to heal from the job began again at step 1;
the Manager's own allreduce turns into a no-op after an error, as documented.
``--eval_pause S`` keeps rank 0 busy in the eval for at least S more seconds (forward
passes on a fixed batch: CPU time, no RNG), the long eval of a real run.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _record import Recorder
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, block: int, n_layer: int, n_head: int, n_embd: int, dropout: float
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.size(1))
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def make_corpus(n_tokens: int, vocab: int) -> torch.Tensor:
    """A stand-in for a tokenized text file: phrases of a small grammar, so the loss falls."""
    g = torch.Generator().manual_seed(42)
    words = [
        torch.randint(vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        for _ in range(32)
    ]
    out, n = [], 0
    while n < n_tokens:
        w = words[int(torch.randint(len(words), (1,), generator=g))]
        out.append(w)
        n += len(w)
    return torch.cat(out)[:n_tokens]


class Windows(torch.utils.data.Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """Non-overlapping (x, y) windows of the train split: the epoch data for --data epoch."""

    def __init__(self, data: torch.Tensor, block: int, n: int) -> None:
        self.data, self.block, self.n = data, block, min(n, (len(data) - 1) // block)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block : (i + 1) * self.block + 1]
        return i, chunk[:-1], chunk[1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true", help="a plain torchrun script: no stalwart")
    p.add_argument("--torchft", action="store_true", help="torchft's port: no stalwart")
    p.add_argument("--out", required=True, help="folder for the trace and final digests")
    p.add_argument("--max_iters", type=int, default=20)
    p.add_argument("--eval_interval", type=int, default=8)
    p.add_argument("--eval_iters", type=int, default=4)
    p.add_argument("--eval_pause", type=float, default=0.0)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_head", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--vocab_size", type=int, default=65)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--min_lr", type=float, default=1e-4)
    p.add_argument("--warmup_iters", type=int, default=4)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--data", choices=["randint", "epoch"], default="randint")
    p.add_argument("--epoch_windows", type=int, default=96, help="--data epoch: samples per epoch")
    p.add_argument("--schedule", choices=["manual", "cosine"], default="manual")
    p.add_argument("--init_from", choices=["scratch", "resume"], default="scratch")
    p.add_argument("--always_save_checkpoint", action="store_true")
    a = p.parse_args()
    if (a.plain or a.torchft) and a.data == "epoch":
        p.error("--data epoch uses stalwart.data.loader; it needs stalwart (drop --plain)")

    sess = None
    if a.torchft:  # a replica group of one worker each: torchft's own world
        rank, world = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    elif a.plain:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        sess = stalwart.init()  # stalwart
        rank, world = sess.rank, sess.world_size
    member = sess.env.rank if sess is not None else rank
    master = rank == 0
    torch.manual_seed(1337 + rank)

    data = make_corpus(4000, a.vocab_size)
    train_data, val_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)) :]

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        d = train_data if split == "train" else val_data
        ix = torch.randint(len(d) - a.block_size, (a.batch_size,))
        x = torch.stack([d[i : i + a.block_size] for i in ix])
        y = torch.stack([d[i + 1 : i + 1 + a.block_size] for i in ix])
        return x, y, ix.tolist()

    model = GPT(a.vocab_size, a.block_size, a.n_layer, a.n_head, a.n_embd, a.dropout)
    manager = None
    if a.torchft:
        from torchft import Manager, ProcessGroupGloo
        from torchft import Optimizer as FTOptimizer

        raw_model = model

        def load_state_dict(sd: dict[str, object]) -> None:  # a healing group, from a peer
            raw_model.load_state_dict(sd["model"])  # type: ignore[arg-type]
            inner.load_state_dict(sd["optim"])  # type: ignore[arg-type]

        def state_dict() -> dict[str, object]:
            return {"model": raw_model.state_dict(), "optim": inner.state_dict()}

        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
            min_replica_size=1,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            replica_id=f"nanogpt_{rank}",
            timeout=timedelta(seconds=30),
        )
        inner = raw_model.configure_optimizers(a.weight_decay, a.learning_rate)
        optimizer = FTOptimizer(manager, inner)
    else:
        model = DDP(model)
        raw_model = model.module
        optimizer = raw_model.configure_optimizers(a.weight_decay, a.learning_rate)

    def get_lr(it: int) -> float:
        if it < a.warmup_iters:
            return a.learning_rate * (it + 1) / (a.warmup_iters + 1)
        ratio = (it - a.warmup_iters) / max(1, a.max_iters - a.warmup_iters)
        return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (a.learning_rate - a.min_lr)

    state: dict[str, object] = {"model": model, "optimizer": optimizer}
    loader = None
    if a.schedule == "cosine":
        state["scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda it: get_lr(it) / a.learning_rate
        )
    if a.data == "epoch":
        assert sess is not None
        loader = stalwart.data.loader(
            Windows(train_data, a.block_size, a.epoch_windows), a.batch_size
        )
        state["loader"] = loader
    if sess is not None:
        sess.track(**state)  # stalwart
    if loader is not None:
        assert sess is not None
        global_batch = a.batch_size * a.gradient_accumulation_steps * world
        sess.use_batch(
            stalwart.data.BatchConfig(global_batch=global_batch, micro_batch=a.batch_size)
        )

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(a.eval_iters)
            for k in range(a.eval_iters):
                X, Y, _ = get_batch(split)
                _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        if a.eval_pause:  # a long eval: more forward passes, on a fixed batch (no RNG)
            x = train_data[: a.block_size].repeat(a.batch_size, 1)
            deadline = time.monotonic() + a.eval_pause
            while time.monotonic() < deadline:
                model(x, x)
        model.train()
        return out

    rec = Recorder(a.out, member)
    best_val_loss = 1e9
    iter_start = 1
    ckpt_path = os.path.join(a.out, "ckpt.pt")
    if a.plain and a.init_from == "resume" and os.path.exists(ckpt_path):
        checkpoint = torch.load(ckpt_path, map_location="cpu")
        raw_model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_start, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
        print(f"resuming from iter {iter_start}", flush=True)
    t0 = time.time()
    plain_iters: Iterator[int] | range = range(iter_start, a.max_iters + 1)
    if manager is not None:

        def ft_iters() -> Iterator[int]:  # torchft: the step is the manager's (a heal moves it)
            while manager.current_step() < a.max_iters:
                optimizer.zero_grad()  # starts the quorum
                yield manager.current_step() + 1

        plain_iters = ft_iters()
    iters = sess.steps(a.max_iters) if sess is not None else plain_iters  # stalwart
    for iter_num in iters:
        if a.schedule == "manual":
            lr = get_lr(iter_num)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
        if iter_num % a.eval_interval == 0 and master:
            losses = estimate_loss()
            print(
                f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
            )
            if losses["val"] < best_val_loss or a.always_save_checkpoint:
                best_val_loss = min(best_val_loss, losses["val"])
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                    "config": vars(a),
                }
                torch.save(checkpoint, ckpt_path + ".tmp")  # a kill mid-save keeps the old one
                os.replace(ckpt_path + ".tmp", ckpt_path)
        if loader is not None:
            micro = [(x, y, idx.tolist()) for idx, x, y in loader.step_batches()]
        else:
            micro = [get_batch("train") for _ in range(a.gradient_accumulation_steps)]
        lossf, seen = 0.0, []
        for micro_step, (X, Y, ix) in enumerate(micro):
            model.require_backward_grad_sync = micro_step == len(micro) - 1
            _, loss = model(X, Y)
            loss = loss / len(micro)
            loss.backward()
            lossf += loss.item()
            seen += ix
        if manager is not None:  # torchft: average the gradients over the quorum's groups
            grads = [q.grad for q in raw_model.parameters() if q.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()
            for g, avg in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(avg.view_as(g))
        if a.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        optimizer.step()
        if "scheduler" in state:
            state["scheduler"].step()  # type: ignore[attr-defined]
        if manager is None:
            optimizer.zero_grad(set_to_none=True)
        if sess is not None:
            sess.log(loss=lossf)  # stalwart
        if manager is not None:  # only a committed step counts (a failed one is retried)
            committed = manager.current_step() >= iter_num
            iter_num = manager.current_step()
        if (sess is None or sess.step_ok) and (manager is None or committed):
            gen = sess.generation if sess is not None else 0
            world = sess.world_size if sess is not None else world
            epoch = loader.epoch if loader is not None else 0
            rec.step(
                iter_num,
                generation=gen,
                rank=rank,
                world=world,
                loss=lossf,
                samples=seen,
                epoch=epoch,
            )
        if master and iter_num % 10 == 0:
            print(f"iter {iter_num}: loss {lossf:.4f}, time {time.time() - t0:.1f}s", flush=True)
    rec.final(raw_model.state_dict(), step=a.max_iters, world=world)
    if sess is not None:
        sess.close()  # stalwart
    elif manager is not None:
        manager.shutdown(wait=False)
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
