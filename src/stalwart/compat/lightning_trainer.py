"""Lightning's internals stalwart's Lightning integration relies on.

tests/compat/test_lightning_trainer.py fails, naming the use, when Lightning changes one.
Tested with Lightning 2.6.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "MODEL_CHECKPOINT_PRIVATE",
    "data_fetcher",
    "logger_version_unset",
    "set_logger_version",
]

# ModelCheckpoint's state outside its state_dict() (the step of its last save, a save
# deferred to the validation's end, the last file saved): a rollback to an earlier step
# puts it back, or the callback skips or misnames the next save (integrations/_pl_callbacks.py)
MODEL_CHECKPOINT_PRIVATE = (
    "_last_global_step_saved",
    "_defer_save_until_validation",
    "_last_checkpoint_saved",
)


def data_fetcher(fit_loop: Any) -> Any:
    """The fit loop's train data fetcher (``_FitLoop._data_fetcher``; None before the
    first epoch). Lightning opens the train iterator only at an epoch's start; a rollback
    to a step inside an epoch reopens it (``iter(fetcher)``) at that step."""
    return fit_loop._data_fetcher


def logger_version_unset(logger: Any) -> bool:
    """Whether ``logger`` (``TensorBoardLogger``, ``CSVLogger``) takes its ``version_N``
    lazily (its ``_version`` is None): the public ``version`` picks one when read."""
    return "_version" in vars(logger) and logger._version is None


def set_logger_version(logger: Any, version: int | str) -> None:
    """Give ``logger`` its version (``_version``) before it picks one: a replaced rank 0
    keeps the run's folder."""
    logger._version = version
