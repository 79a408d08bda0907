"""FSDP2 under flash: survivors keep their FSDP module and optimizer across a re-formed
group, and the run ends with the same parameters, bit for bit, as one without faults."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ._launch import events_of, stalwart_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_fsdp.py"
ARGS = ["--steps", "16", "--dim", "16", "--layers", "2", "--seq", "8", "--batch", "4"]


def _train(run_dir: Path, extra: list[str]) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}.pt"
    proc = stalwart_run(
        run_dir,
        ["--nproc-per-node", "2", *extra, str(EXAMPLE), *ARGS, "--out", str(out)],
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
    return state


@pytest.mark.timeout(240)
def test_fsdp2_flash_kill_and_hang_bit_identical(tmp_path: Path) -> None:
    reference = _train(tmp_path / "ref", [])
    # rank 1 is killed once the optimizer holds state (the replacement restores
    # DTensor moments into a fresh optimizer); rank 0 hangs later (a survivor's
    # collective fails, it rolls back in place)
    chaos = ["--chaos", "kill rank=1 at=step:4; hang rank=0 at=step:11"]
    faulty = _train(tmp_path / "flash", chaos)
    assert reference.keys() == faulty.keys()
    for name, tensor in reference.items():
        assert torch.equal(tensor, faulty[name]), name
    events = events_of(tmp_path / "flash")
    assert [f["fault"] for k, f in events if k == "fault_detected"] == ["crash", "hang"]
    ends = [f for k, f in events if k == "recovery_end"]
    assert [f["source_tier"] for f in ends] == ["memory", "memory"]
    assert [f["status"] for k, f in events if k == "run_end"] == ["ok"]
