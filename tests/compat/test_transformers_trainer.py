"""stalwart.compat.transformers_trainer against the installed transformers (and
Accelerate): the Trainer's private methods and loop totals it relies on."""

from __future__ import annotations

import inspect

import pytest

from stalwart.compat import transformers_trainer as hf

from ._seam import changed, relied_on

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
accelerate = pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
V = f"transformers {transformers.__version__}"


def test_the_trainers_private_methods_take_what_stalwart_passes() -> None:
    t = transformers.Trainer
    relied_on(
        t,
        "_inner_training_loop",
        version=V,
        by="transformers_trainer.inner_training_loop",
        params=["batch_size", "args", "resume_from_checkpoint"],
    )
    loop = inspect.signature(t._inner_training_loop).parameters
    assert "ignore_keys_for_eval" in loop, changed(
        "Trainer._inner_training_loop",
        V,
        "transformers_trainer.inner_training_loop",
        "takes no ignore_keys_for_eval",
    )
    relied_on(t, "_prepare_for_training", version=V, by="transformers_trainer.prepare_for_training")
    relied_on(
        t,
        "_finalize_training",
        version=V,
        by="transformers_trainer.finalize_training",
        params=["trial", "num_train_samples", "start_time"],
    )


def test_the_loop_keeps_its_totals_in_the_named_attributes() -> None:
    source = inspect.getsource(transformers.Trainer)
    for name in hf.LOOP_TOTALS:
        assert f"self.{name} =" in source or f"self.{name}:" in source, changed(
            f"Trainer.{name}",
            V,
            "transformers_trainer.read_loop_totals",
            "is no longer set by the Trainer's loop",
        )


def test_accelerate_keeps_a_list_of_prepared_models() -> None:
    acc = accelerate.Accelerator(cpu=True)
    held = relied_on(
        acc,
        "_models",
        version=f"accelerate {accelerate.__version__}",
        by="transformers_trainer.prepared_models",
        label="Accelerator",
    )
    assert isinstance(held, list)

    class _T:
        accelerator = acc

    assert hf.prepared_models(_T()) is held


def test_the_totals_round_trip_through_a_trainer_like_object() -> None:
    import torch

    class _T:
        _total_loss_scalar = 0.0
        _tr_loss = torch.zeros(())
        _globalstep_last_logged = 0
        _initial_global_step = 0

    t = _T()
    hf.write_loop_totals(t, total_loss=2.5, tr_loss=0.5, last_logged=4, initial_step=2)
    got = hf.read_loop_totals(t)
    assert got["total_loss_scalar"] == 2.5 and float(got["tr_loss"]) == 0.5
    assert (got["globalstep_last_logged"], got["initial_global_step"]) == (4, 2)
