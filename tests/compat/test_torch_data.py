"""stalwart.compat.torch_data against the installed torch: a DataLoader's workers stop on
demand and its persistent iterator can be dropped."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from stalwart.compat import torch_data

from ._seam import changed, relied_on

V = f"torch {torch.__version__}"


def test_the_iterator_and_the_loader_have_the_internals() -> None:
    relied_on(
        _MultiProcessingDataLoaderIter,
        "_shutdown_workers",
        version=V,
        by="torch_data.worker_shutdown",
        params=[],
    )
    dl = DataLoader(list(range(4)))
    assert "_iterator" in vars(dl), changed(
        "DataLoader._iterator", V, "torch_data.forget_iterator", "is gone"
    )


def test_a_single_process_iterator_has_no_workers_to_stop() -> None:
    assert torch_data.worker_shutdown(iter(DataLoader(list(range(4))))) is None
    assert torch_data.worker_shutdown(None) is None


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_workers_stop_and_the_next_epoch_gets_new_ones() -> None:
    dl = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    it = iter(dl)
    assert next(it).tolist() == [0, 1]
    workers = list(it._workers)  # type: ignore[attr-defined]
    shutdown = torch_data.worker_shutdown(it)
    assert shutdown is not None
    shutdown()
    for w in workers:
        w.join(timeout=60)
        assert not w.is_alive(), changed(
            "_MultiProcessingDataLoaderIter._shutdown_workers",
            V,
            "torch_data.worker_shutdown",
            "left a worker process running",
        )
    assert vars(dl)["_iterator"] is it  # persistent: kept for the next epoch (and dead now)
    torch_data.forget_iterator(dl)
    fresh = iter(dl)
    assert fresh is not it, changed(
        "DataLoader._iterator", V, "torch_data.forget_iterator", "no longer holds the iterator"
    )
    assert [b.tolist() for b in fresh] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    shutdown = torch_data.worker_shutdown(fresh)
    assert shutdown is not None
    shutdown()
