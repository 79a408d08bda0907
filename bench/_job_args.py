"""The flags every bench job script shares (the model's size, the steps, where the step
log goes): one parser, so the benchmarks that compare jobs run them at the same sizes."""

from __future__ import annotations

import argparse

__all__ = ["job_parser"]


def job_parser(*, steps: int, seq: int) -> argparse.ArgumentParser:
    """``--steps``, ``--step-log`` (required), ``--dim``, ``--layers`` and ``--seq``, with
    this job's defaults for ``steps`` and ``seq``; the job adds its own flags."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--step-log", required=True)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=seq)
    return p
