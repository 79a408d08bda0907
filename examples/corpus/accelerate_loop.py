"""An Accelerate loop: a Transformers GPT-2 trained by a hand-written loop over
``Accelerator.prepare``, ported to stalwart.

Written in the style of Accelerate's examples (``nlp_example.py``): ``set_seed``, a
``GPT2LMHeadModel`` from a tiny ``GPT2Config`` (no download; dropout on), a shuffled
``DataLoader``, ``AdamW`` and ``get_linear_schedule_with_warmup``, everything passed
through ``accelerator.prepare``, ``accelerator.backward``, ``accelerator.clip_grad_norm_``,
and every ``eval_steps`` an eval whose losses are gathered with
``accelerator.gather_for_metrics``. The Accelerator seeds its sampler per epoch
(``use_seedable_sampler=True``: stalwart's StepBatches refuses the default sampler).

The stalwart lines are marked; ``--plain`` runs the same loop as a plain torchrun script
(with ``StepBatches`` too: the batches by step are what the trace compares).
``--gradient_accumulation_steps K`` steps the optimizer every K steps (a step per
micro-batch under ``accelerator.accumulate``); ``--eval_pause S`` makes every eval at
least S seconds longer; ``--bug_step N`` makes the rank launched as ``--bug_rank`` raise
at step N in every incarnation.
"""

from __future__ import annotations

import argparse
import time

import torch
from _copytask import CopyTask
from _record import Recorder
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup, set_seed

from stalwart.integrations import accelerate as stalwart_accelerate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true", help="a plain torchrun script: no stalwart")
    p.add_argument("--out", required=True, help="folder for the trace and final digests")
    p.add_argument("--max_steps", type=int, default=16)
    p.add_argument("--train_samples", type=int, default=64)
    p.add_argument("--eval_samples", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=16)
    p.add_argument("--eval_steps", type=int, default=6)
    p.add_argument("--eval_pause", type=float, default=0.0)
    p.add_argument("--bug_step", type=int, default=0, help="raise at this step (0: never)")
    p.add_argument("--bug_rank", type=int, default=1)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    a = p.parse_args()

    sess = None
    if not a.plain:
        import stalwart

        sess = stalwart.init()  # stalwart: before Accelerator()
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=a.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(42)
    config = GPT2Config(
        vocab_size=64,
        n_positions=a.seq_len,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    train_ds = CopyTask(a.train_samples, a.seq_len, config.vocab_size, salt=1)
    eval_ds = CopyTask(a.eval_samples, a.seq_len, config.vocab_size, salt=2)
    train_dl = DataLoader(train_ds, batch_size=a.batch_size, shuffle=True, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=a.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, 3, a.max_steps)
    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, lr_scheduler
    )
    if sess is not None:  # stalwart
        stalwart_accelerate.track(
            sess,
            accelerator=accelerator,  # stalwart: rollbacks at an accumulation cycle's end
            model=model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
        )
    batch_for = stalwart_accelerate.StepBatches(train_dl)  # stalwart (the batch of a step)

    def evaluate() -> float:
        model.eval()
        losses = []
        for batch in eval_dl:
            with torch.no_grad():
                out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            losses.append(accelerator.gather_for_metrics(out.loss.reshape(1)))
            t_end = time.monotonic() + a.eval_pause
            x = torch.ones(64, 64)
            while time.monotonic() < t_end:  # CPU-busy, as a long eval is
                x = torch.tanh(x @ x)
        model.train()
        return torch.cat(losses).mean().item()

    member = sess.env.rank if sess is not None else accelerator.process_index
    rec = Recorder(a.out, member)
    model.train()
    steps = sess.steps(a.max_steps) if sess is not None else range(1, a.max_steps + 1)
    for step in steps:
        batch = batch_for(step)
        if member == a.bug_rank and step == a.bug_step:
            raise ValueError("corpus-bug: label 7 out of range in shard file 3")
        with accelerator.accumulate(model):
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            accelerator.backward(out.loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        extra: dict[str, object] = {}
        if step % a.eval_steps == 0:
            if sess is not None:
                with sess.pause("eval"):  # stalwart
                    extra["eval"] = evaluate()
            else:
                extra["eval"] = evaluate()
        if sess is not None:
            sess.log(loss=out.loss)  # stalwart
        if sess is None or sess.step_ok:
            rec.step(
                step,
                generation=sess.generation if sess is not None else 0,
                rank=accelerator.process_index,
                world=accelerator.num_processes,
                loss=out.loss.item(),
                samples=batch["index"].tolist(),
                **extra,
            )
    rec.final(
        accelerator.unwrap_model(model).state_dict(),
        step=a.max_steps,
        world=accelerator.num_processes,
    )
    if sess is not None:
        sess.close()  # stalwart


if __name__ == "__main__":
    main()
