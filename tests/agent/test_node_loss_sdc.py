"""A node loss with the replica digest checks on (issue 16): each DDP rank then keeps
three snapshot slots (the verified one stays pinned), and node 0's adopted ranks restore
the agreed step from a survivor's slots, wherever of the three it sits. The run ends
bit-identical to a fault-free run (the checks off: they read the state, they do not
change it; ``two_node_reference``, tests/agent/conftest.py), and the checks after the
loss pass on all 4 ranks (the adopted ranks' state equals the survivors')."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _load import node_lease

from ._launch import events_of, stalwart_run_nodes
from .conftest import LM_ARGS, TRAIN_LM

K = 2  # a check every other step: the pinned slot moves while the job runs


def _train(run_dir: Path, chaos: list[str]) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}.pt"
    flags = ["--nproc-per-node", "2", "--node-lease", node_lease(), "--sdc-every", str(K), *chaos]
    cmd = [*flags, str(TRAIN_LM), *LM_ARGS, "--out", str(out)]
    codes = stalwart_run_nodes(run_dir, 2, cmd, timeout=280)  # imports alone take minutes
    assert codes[0][0] == 0, codes[0][1][-3000:]
    state: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
    return state


@pytest.mark.timeout(600)
def test_a_node_loss_with_the_digest_checks_on_restores_from_a_survivors_slots(
    tmp_path: Path, two_node_reference: dict[str, torch.Tensor]
) -> None:
    reference = two_node_reference
    lost = _train(tmp_path / "lost", ["--chaos", "kill node=1 at=step:15"])
    assert reference.keys() == lost.keys()
    for name, tensor in reference.items():
        assert torch.equal(tensor, lost[name]), name
    events = events_of(tmp_path / "lost")
    assert [f["fault"] for k, f in events if k == "fault_detected"] == ["node_loss"]
    ends = [f for k, f in events if k == "recovery_end"]
    assert ends and ends[-1]["source_tier"] == "peer", ends
    restored = int(str(ends[-1]["restored_step"]))
    after = [f for k, f in events if k == "sdc_check" and int(str(f["step"])) > restored]
    assert after and all(f["replicas"] == 4 for f in after), after
    assert not [f for k, f in events if k == "sdc_detected"]
