"""The key invariant: a run with a kill and a hang recovered by `flash` ends with the
same parameters, bit for bit, as a run without faults (CPU, deterministic ops)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ._launch import events_of, stalwart_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
ARGS = ["--steps", "24", "--dim", "32", "--layers", "1", "--seq", "16", "--batch", "4"]


def _train(run_dir: Path, extra: list[str]) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}.pt"
    proc = stalwart_run(
        run_dir,
        [
            "--nproc-per-node",
            "2",
            "--hang-floor",
            "1",
            *extra,
            str(EXAMPLE),
            *ARGS,
            "--out",
            str(out),
        ],
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
    return state


@pytest.mark.timeout(240)
def test_flash_recovers_bit_identical(tmp_path: Path) -> None:
    reference = _train(tmp_path / "ref", [])
    faulty = _train(
        tmp_path / "chaos", ["--chaos", "kill rank=1 at=step:5; hang rank=0 at=step:15"]
    )
    assert reference.keys() == faulty.keys()
    for name, tensor in reference.items():
        assert torch.equal(tensor, faulty[name]), name
    events = events_of(tmp_path / "chaos")
    detected = [f["fault"] for k, f in events if k == "fault_detected"]
    assert detected == ["crash", "hang"]
    ends = [f for k, f in events if k == "recovery_end"]
    assert len(ends) == 2 and all(f["source_tier"] == "memory" for f in ends)
    assert [f["status"] for k, f in events if k == "run_end"] == ["ok"]
