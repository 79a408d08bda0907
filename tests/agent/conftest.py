"""Fault-free reference runs shared by the agent's job tests: a whole job each (two
agents, four workers), so computed once per test run (issue 26) and judged against by
every test of the same shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _load import node_lease

from ._launch import stalwart_run_nodes

__all__ = ["LM_ARGS", "TRAIN_LM", "two_node_reference"]

TRAIN_LM = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
LM_ARGS = ["--steps", "24", "--dim", "32", "--layers", "1", "--seq", "16", "--batch", "4"]


@pytest.fixture(scope="session")
def two_node_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """examples/train_lm.py (``LM_ARGS``) without faults on 2 agents x 2 workers on
    loopback (node lease 2 s): the final parameters a faulted run of that shape (its
    flags change how faults are found and recovered, not the training) must match."""
    run_dir = tmp_path_factory.mktemp("two-node-reference") / "ref"
    out = run_dir.parent / "ref.pt"
    flags = ["--nproc-per-node", "2", "--node-lease", node_lease()]
    codes = stalwart_run_nodes(
        run_dir, 2, [*flags, str(TRAIN_LM), *LM_ARGS, "--out", str(out)], timeout=280
    )
    assert codes[0][0] == 0, codes[0][1][-3000:]
    state: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
    return state
