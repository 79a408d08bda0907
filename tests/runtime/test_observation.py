"""A ported run computes what the plain script computes: the session's snapshots (the
step-0 one included, taken before the optimizer has state) change nothing. The script is
torchtitan-like: an optimizer container whose state_dict() is DCP's flattened
get_optimizer_state_dict (tests/checkpoint/_titan.py), which steps a stateless optimizer
once with zero gradients unless stalwart keeps it from doing so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _load import scaled

from stalwart.contract.env import CONTRACT_VAR, CONTRACT_VERSION

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {models!r})
    from _titan import make_titan, titan_step

    state, losses = make_titan(), []
    if sys.argv[1] == "ported":
        import stalwart

        sess = stalwart.init()
        sess.track(**state)
        for step in sess.steps(total=8):
            losses.append(titan_step(state))
        assert len(sess.acct.stalls) >= 8, sess.acct.stalls  # a snapshot every step
    else:
        for _ in range(8):
            losses.append(titan_step(state))
    print("LOSSES", json.dumps(losses))
    """
)


def _losses(script: Path, how: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != CONTRACT_VAR}
    if how == "ported":  # run alone, a snapshot after every step (and the step-0 one)
        env[CONTRACT_VAR] = json.dumps({"version": CONTRACT_VERSION, "snapshot_every": 1})
    out = subprocess.run(
        [sys.executable, str(script), how],
        cwd=script.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("LOSSES "))
    return [float(v) for v in json.loads(line.removeprefix("LOSSES "))]


def test_a_ported_run_with_snapshots_at_every_step_has_the_plain_runs_losses(
    tmp_path: Path,
) -> None:
    models = str(Path(__file__).resolve().parents[1] / "checkpoint")
    script = tmp_path / "titan_like.py"
    script.write_text(_SCRIPT.format(models=models))
    plain = _losses(script, "plain")
    assert _losses(script, "ported") == plain  # bit for bit: the same floats
