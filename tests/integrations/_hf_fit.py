"""The transformers half of tests/integrations/test_transformers.py: a tiny GPT-2 and a
``Trainer`` over it. Imported by that module's ``hf`` fixture when a test runs, so that
collecting the suite does not import transformers (seconds on a loaded machine)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import transformers

from stalwart.integrations.transformers import StalwartCallback, TrainerNotFoundError

from ._fake import FakeSession

__all__ = ["Losses", "StalwartCallback", "TrainerNotFoundError", "train", "transformers"]


class Copy(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, salt: int) -> None:
        self.n, self.salt = n, salt

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.salt * 1009 + i)
        half = torch.randint(1, 32, (4,), generator=g)
        ids = torch.cat([half, half])
        return {"input_ids": ids, "labels": ids.clone()}


class Losses(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}
        self.evals: dict[int, float] = {}
        self.summary: dict[str, float] = {}  # train()'s metrics (train_loss, total_flos, ...)
        self.eval_keys: set[str] = set()  # every key an eval logged

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if "loss" in logs:
            self.by_step[state.global_step] = logs["loss"]  # a redone step overwrites
        if "eval_loss" in logs:
            self.evals[state.global_step] = logs["eval_loss"]
            self.eval_keys.update(logs)


def train(
    sess: FakeSession | None,
    max_steps: int = 14,
    accumulation: int = 1,
    save_steps: int = 0,
    logging_steps: int = 1,
) -> tuple[list[torch.Tensor], Losses]:
    """6 batches an epoch (24 samples, batch 4), a step per ``accumulation`` of them, an
    eval every 4 steps, a checkpoint every ``save_steps`` (0: none); after ``train()``
    the model card, as run_clm.py writes it (its ``KeyError`` fails the test)."""
    cb = StalwartCallback(session=sess) if sess is not None else None  # type: ignore[arg-type]
    transformers.set_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=max_steps, per_device_train_batch_size=4,
            per_device_eval_batch_size=4, learning_rate=3e-3, lr_scheduler_type="cosine",
            warmup_steps=2, eval_strategy="steps", eval_steps=4, logging_steps=logging_steps,
            save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
            report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
            gradient_accumulation_steps=accumulation,
        )  # fmt: skip
        losses = Losses()
        callbacks = [losses] + ([cb] if cb is not None else [])
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=Copy(24, 1), eval_dataset=Copy(8, 2),
            callbacks=callbacks,
        )  # fmt: skip
        result = trainer.train()
        losses.summary = dict(result.metrics, total_flos=trainer.state.total_flos)
        trainer.create_model_card(model_name="tiny", finetuned_from="scratch")
    return [p.detach().clone() for p in model.parameters()], losses
