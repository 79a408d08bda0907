"""stalwart.compat.lightning_trainer against the installed Lightning: the fit loop's
fetcher, a logger's lazy version, ModelCheckpoint's private state."""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.compat import lightning_trainer as pl_compat

from ._seam import changed

pl = pytest.importorskip("lightning.pytorch", reason="the [lightning] extra is not installed")
V = f"lightning {pl.__version__}"


def test_the_fit_loop_has_its_fetcher() -> None:
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert "_data_fetcher" in vars(trainer.fit_loop), changed(
        "_FitLoop._data_fetcher", V, "lightning_trainer.data_fetcher", "is gone"
    )
    assert pl_compat.data_fetcher(trainer.fit_loop) is None  # before the first epoch


@pytest.mark.parametrize("kind", ["TensorBoardLogger", "CSVLogger"])
def test_a_loggers_version_is_picked_lazily_and_can_be_given(kind: str, tmp_path: Any) -> None:
    cls = getattr(pl.loggers, kind)
    if kind == "TensorBoardLogger":
        pytest.importorskip("tensorboard", reason="TensorBoardLogger needs tensorboard")
    logger = cls(str(tmp_path))
    assert pl_compat.logger_version_unset(logger), changed(
        f"{kind}._version", V, "lightning_trainer.logger_version_unset", "is not None at first"
    )
    pl_compat.set_logger_version(logger, 7)
    assert logger.version == 7, changed(
        f"{kind}._version", V, "lightning_trainer.set_logger_version", "is not what .version reads"
    )
    assert not pl_compat.logger_version_unset(logger)
    fixed = cls(str(tmp_path), version=3)
    assert not pl_compat.logger_version_unset(fixed)


def test_model_checkpoint_keeps_the_named_private_state() -> None:
    cb = pl.callbacks.ModelCheckpoint()
    missing = [n for n in pl_compat.MODEL_CHECKPOINT_PRIVATE if n not in vars(cb)]
    assert not missing, changed(
        f"ModelCheckpoint.{missing}", V, "lightning_trainer.MODEL_CHECKPOINT_PRIVATE", "is gone"
    )
