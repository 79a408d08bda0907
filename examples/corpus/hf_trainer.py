"""A ``transformers.Trainer`` script: a tiny GPT-2 trained by the Trainer itself, with
stalwart's callback.

Written the way Trainer scripts are: ``set_seed``, a ``GPT2LMHeadModel`` from a tiny
``GPT2Config`` (no download; tied embedding and head; dropout on), a map-style dataset,
``TrainingArguments`` with ``max_steps``, a cosine schedule with warmup, ``eval_steps``
evals on an eval set, ``logging_steps=1``, and ``trainer.train()``. The Trainer builds the
sampler, the DataLoader, DDP (through Accelerate), the optimizer and the scheduler. After
training it does what run_clm.py does: ``save_model``, ``log_metrics``/``save_metrics``
(``train_results.json``), ``save_state`` and ``create_model_card``; preprocessing sits
under ``training_args.main_process_first()`` (a barrier before the first step).
``--gradient_accumulation_steps`` and ``--save_steps`` (checkpoints) are the Trainer's.

The two stalwart lines are marked ``# stalwart``; ``--plain`` runs the same script without
them (under torchrun). ``RecordCallback`` and the collator's index list only write what
tests/corpus/test_matrix.py judges a run by (examples/corpus/_record.py): they are not part
of the style. ``--eval_pause S`` makes every eval batch at least S seconds longer
(CPU-busy); ``--bug_step N`` makes the rank launched as ``--bug_rank`` raise at step N;
``--train_file`` naming a missing file fails every rank at start-up, as run_clm.py does.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from _copytask import CopyTask
from _record import Recorder
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


class Collate:
    """Stacks a batch; keeps the sample indices of the last training batch for the trace."""

    def __init__(self) -> None:
        self.last: list[int] = []

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        index = batch.pop("index").tolist()
        if index and index[0] >= 0:  # an eval batch is collated here too: keep the train one
            self.last = index
        return batch


class RecordCallback(TrainerCallback):
    """The trace of examples/corpus/_record.py: one line per committed attempt of a step."""

    def __init__(self, rec: Recorder, collate: Collate, stalwart_cb: Any, pause: float) -> None:
        self.rec, self.collate, self.stalwart_cb, self.pause = rec, collate, stalwart_cb, pause
        self.evals: dict[int, float] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        logs = logs or {}
        if "eval_loss" in logs:
            self.evals[state.global_step] = logs["eval_loss"]
        if "loss" not in logs:
            return
        gen, rank, world = 0, args.process_index, args.world_size
        if self.stalwart_cb is not None:
            sess = self.stalwart_cb.session
            gen, rank, world = sess.generation, sess.rank, sess.world_size
        self.rec.step(
            state.global_step,
            generation=gen,
            rank=rank,
            world=world,
            loss=logs["loss"],
            lr=logs.get("learning_rate"),
            samples=self.collate.last,
        )

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        t_end = time.monotonic() + self.pause
        x = torch.ones(64, 64)
        while time.monotonic() < t_end:  # CPU-busy, as a long eval is
            x = torch.tanh(x @ x)


class Bug(TrainerCallback):
    """A deterministic bug (``--bug_step``): the rank launched as ``--bug_rank`` raises
    at that step in every incarnation, as a bad shard of data would make it."""

    def __init__(self, member: int, rank: int, step: int) -> None:
        self.armed = member == rank and step > 0
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.armed and state.global_step + 1 == self.step:
            raise ValueError("corpus-bug: label 7 out of range in shard file 3")


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
    p.add_argument("--eval_pause", type=float, default=0.0)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--bug_step", type=int, default=0, help="raise at this step (0: never)")
    p.add_argument("--bug_rank", type=int, default=1)
    p.add_argument("--train_file", default="", help="a missing file: a start-up error")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--save_steps", type=int, default=0, help="a checkpoint every N (0: none)")
    a = p.parse_args()

    stalwart_cb = None
    if not a.plain:
        from stalwart.integrations.transformers import StalwartCallback  # stalwart

        stalwart_cb = StalwartCallback()  # stalwart: joins the job, before TrainingArguments

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
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=os.path.join(a.out, "hf"),
        max_steps=a.max_steps,
        per_device_train_batch_size=a.per_device_batch_size,
        per_device_eval_batch_size=a.per_device_batch_size,
        learning_rate=a.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        weight_decay=0.01,
        eval_strategy="steps",
        eval_steps=a.eval_steps,
        logging_steps=1,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        gradient_accumulation_steps=a.gradient_accumulation_steps,
        report_to=[],
        use_cpu=True,
        seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,  # the collator takes "index" out itself
    )
    with args.main_process_first(desc="dataset map pre-processing"):  # as run_clm.py
        if a.train_file and not os.path.exists(a.train_file):  # as load_dataset's refusal
            raise FileNotFoundError(f"Unable to find '{a.train_file}'")
        train_ds = CopyTask(a.train_samples, a.seq_len, config.vocab_size, salt=1)
        eval_ds = CopyTask(a.eval_samples, a.seq_len, config.vocab_size, salt=2)
    collate = Collate()
    member = int(os.environ.get("RANK", "0"))
    if stalwart_cb is not None:
        member = stalwart_cb.session.env.rank
    rec = Recorder(a.out, member)
    callbacks: list[TrainerCallback] = [RecordCallback(rec, collate, stalwart_cb, a.eval_pause)]
    if stalwart_cb is not None:
        callbacks.append(stalwart_cb)
    callbacks.append(Bug(member, a.bug_rank, a.bug_step))  # inside the step stalwart began
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=collate,
        callbacks=callbacks,
    )
    train_result = trainer.train()
    trainer.save_model()  # as run_clm.py does after training
    metrics = train_result.metrics
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    trainer.create_model_card(model_name="corpus-tiny-gpt2")
    # total_flos: in trainer_state.json (the printer callback pops it from the metrics)
    summary = {"train_loss": metrics["train_loss"], "total_flos": trainer.state.total_flos}
    rec.final(trainer.model.state_dict(), step=a.max_steps, world=args.world_size, summary=summary)


if __name__ == "__main__":
    main()
