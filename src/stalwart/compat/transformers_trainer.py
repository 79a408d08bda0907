"""``transformers.Trainer``'s internals stalwart's Trainer callback relies on.

A recovery re-enters the Trainer's loop at the restored step in the same process
(integrations/_hf_trainer.py). ``train()`` cannot do it (it refuses a resume folder
without model weights, and stalwart restored the weights in place), and the loop's
summary totals live in private attributes it resets at every entry. None of this has a
public API. tests/compat/test_transformers_trainer.py fails, naming the use, when
transformers changes one. Tested with transformers 5.24 (and Accelerate 1.15).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "LOOP_TOTALS",
    "finalize_training",
    "inner_training_loop",
    "prepare_for_training",
    "prepared_models",
    "read_loop_totals",
    "replace_finalize_training",
    "replace_prepare_for_training",
    "write_loop_totals",
]

# The Trainer loop's running totals behind ``train_loss`` and the logging cadence, each
# with the value a Trainer that never ran has: the summed loss of the logged steps, the
# loss not yet logged (a tensor once the loop began), the step of the last log, the step
# the run began at. ``_finalize_training`` makes the summary from them.
LOOP_TOTALS: dict[str, Any] = {
    "_total_loss_scalar": 0.0,
    "_tr_loss": None,
    "_globalstep_last_logged": 0,
    "_initial_global_step": 0,
}


def read_loop_totals(trainer: Any) -> dict[str, Any]:
    """The loop's totals (:data:`LOOP_TOTALS`'s names without the underscore)."""
    return {name.lstrip("_"): getattr(trainer, name, v) for name, v in LOOP_TOTALS.items()}


def write_loop_totals(
    trainer: Any, *, total_loss: float, tr_loss: float, last_logged: int, initial_step: int
) -> None:
    """Put the loop's totals back (the unlogged loss into the loop's own tensor)."""
    trainer._total_loss_scalar = total_loss
    held = getattr(trainer, "_tr_loss", None)
    if isinstance(held, torch.Tensor):
        held.fill_(tr_loss)
    trainer._globalstep_last_logged = last_logged
    trainer._initial_global_step = initial_step


def inner_training_loop(
    trainer: Any, resume_from_checkpoint: str | None, ignore_keys: list[str] | None
) -> Any:
    """Run the Trainer's loop (``Trainer._inner_training_loop(args=,
    resume_from_checkpoint=, ignore_keys_for_eval=)``), which ``train()`` wraps."""
    return trainer._inner_training_loop(
        args=trainer.args,
        resume_from_checkpoint=resume_from_checkpoint,
        ignore_keys_for_eval=ignore_keys,
    )


def prepare_for_training(trainer: Any) -> Callable[..., Any]:
    """The Trainer's ``_prepare_for_training`` (the loop's Accelerate preparation, whose
    ``free_memory()`` empties Accelerate's list of prepared models)."""
    fn: Callable[..., Any] = trainer._prepare_for_training
    return fn


def replace_prepare_for_training(trainer: Any, fn: Callable[..., Any]) -> None:
    """Make ``fn`` this Trainer object's ``_prepare_for_training``."""
    trainer._prepare_for_training = fn


def finalize_training(trainer: Any) -> Callable[..., Any]:
    """The Trainer's ``_finalize_training(trial, num_train_samples, start_time)``, which
    measures ``train_runtime`` from ``start_time`` and makes the summary metrics."""
    fn: Callable[..., Any] = trainer._finalize_training
    return fn


def replace_finalize_training(trainer: Any, fn: Callable[..., Any]) -> None:
    """Make ``fn`` this Trainer object's ``_finalize_training``."""
    trainer._finalize_training = fn


def prepared_models(trainer: Any) -> list[Any]:
    """Accelerate's list of the models it prepared (``Accelerator._models``, the list
    itself): an eval takes a model missing from it for one never trained."""
    held: list[Any] = trainer.accelerator._models
    return held
