"""A Hugging Face-style training loop: a Transformers GPT-2 in a plain DDP loop, ported
to stalwart.

Written in the style of the custom loops people write around ``transformers`` models:
``set_seed``, a ``GPT2LMHeadModel`` built from a tiny ``GPT2Config`` (no download; the
embedding and the LM head are one tied tensor; dropout on), a map-style dataset read
through a ``DistributedSampler`` and a ``DataLoader`` (``set_epoch`` each epoch),
``get_cosine_schedule_with_warmup``, gradient clipping, ``zero_grad(set_to_none=True)``,
and every ``eval_steps`` an eval on every rank's shard of the eval set, averaged with a
plain ``dist.all_reduce`` on the default group.

The loader is resumed at the step ``sess.steps()`` hands out (the epoch and the batch in
it follow from the step, as a resumed Trainer skips the batches already seen), so a
rollback replays the same batches (the train loader has its own generator: see there).
The stalwart lines are marked; ``--plain`` runs the same loop as a plain torchrun script.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from _copytask import CopyTask
from _record import Recorder
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup, set_seed

import stalwart


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true", help="a plain torchrun script: no stalwart")
    p.add_argument("--out", required=True, help="folder for the trace and final digests")
    p.add_argument("--max_steps", type=int, default=16)
    p.add_argument("--train_samples", type=int, default=64)
    p.add_argument("--eval_samples", type=int, default=16)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=16)
    p.add_argument("--eval_steps", type=int, default=6)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--warmup_steps", type=int, default=3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    a = p.parse_args()

    sess = None
    if a.plain:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        sess = stalwart.init()  # stalwart
        rank, world = sess.rank, sess.world_size
    member = sess.env.rank if sess is not None else rank
    set_seed(42)

    config = GPT2Config(
        vocab_size=64,
        n_positions=a.seq_len,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    model = DDP(GPT2LMHeadModel(config))
    assert model.module.lm_head.weight is model.module.transformer.wte.weight

    train_ds = CopyTask(a.train_samples, a.seq_len, config.vocab_size, salt=1)
    eval_ds = CopyTask(a.eval_samples, a.seq_len, config.vocab_size, salt=2)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    # its own generator: opening a DataLoader iterator draws a seed from the global RNG
    # otherwise, and the loader is re-opened after a rollback (not in a fault-free run),
    # which would shift every dropout mask after it
    train_dl = DataLoader(
        train_ds,
        batch_size=a.per_device_batch_size,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
    eval_sampler = DistributedSampler(eval_ds, num_replicas=world, rank=rank, shuffle=False)
    eval_dl = DataLoader(eval_ds, batch_size=a.per_device_batch_size, sampler=eval_sampler)

    optimizer = torch.optim.AdamW(model.parameters(), lr=a.learning_rate, weight_decay=0.01)
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, a.warmup_steps, a.max_steps)
    if sess is not None:
        sess.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)  # stalwart

    steps_per_epoch = len(train_dl)
    cursor: dict[str, object] = {"at": None, "it": None}

    def batch_at(step: int) -> dict[str, torch.Tensor]:
        """The batch of ``step``: the loader is re-opened (and skipped ahead) when the
        step is not the one after the previous call, as after a resume or a rollback."""
        epoch, i = divmod(step - 1, steps_per_epoch)
        if i == 0 or cursor["at"] != (epoch, i):
            sampler.set_epoch(epoch)
            cursor["it"] = itertools.islice(iter(train_dl), i, None)
        it = cursor["it"]
        assert isinstance(it, Iterator)
        cursor["at"] = (epoch, i + 1)
        return next(it)

    def evaluate() -> tuple[float, float]:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in eval_dl:
                out = model(input_ids=batch["input_ids"], labels=batch["labels"])
                total += out.loss.item() * len(batch["input_ids"])
                count += len(batch["input_ids"])
        model.train()
        local = total / count
        t = torch.tensor(local)
        dist.all_reduce(t)  # the default group: the job's ranks
        return local, t.item() / world

    rec = Recorder(a.out, member)
    model.train()
    steps = sess.steps(a.max_steps) if sess is not None else range(1, a.max_steps + 1)  # stalwart
    for step in steps:
        batch = batch_at(step)
        outputs = model(input_ids=batch["input_ids"], labels=batch["labels"])
        loss = outputs.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        extra: dict[str, object] = {}
        if step % a.eval_steps == 0:
            extra["eval_local"], extra["eval_avg"] = evaluate()
        if sess is not None:
            sess.log(loss=loss)  # stalwart
        if sess is None or sess.step_ok:
            gen = sess.generation if sess is not None else 0
            samples = batch["index"].tolist()
            rec.step(
                step,
                generation=gen,
                rank=rank,
                world=world,
                loss=loss.item(),
                samples=samples,
                **extra,
            )
        if rank == 0 and step % 8 == 0:
            print(
                f"step {step} loss {loss.item():.4f} lr {lr_scheduler.get_last_lr()[0]:.2e}",
                flush=True,
            )
    rec.final(model.module.state_dict(), step=a.max_steps, world=world)
    if sess is not None:
        sess.close()  # stalwart
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
