"""One node's side of one preflight round, run as its own process by the agent.

``python -m stalwart.agent.health._preflight_round HOST:PORT RANK --n N --reps R --mb M``
times an ``N x N`` float32 matmul (the fastest of ``R``), then joins a two-member gloo
group over a TCPStore at ``HOST:PORT`` (rank 0 hosts it) and times an allreduce of ``M``
MiB (the fastest of ``R``, after a warm-up). The fastest, not the median: the check
measures what the node *can* do; a busy neighbour on a shared host delays some
repetitions, a broken node is slow in every one. It prints one JSON line: ``{"v": 1, "matmul_s":
.., "allreduce_s": ..}`` or ``{"v": 1, "error": ".."}``.

Why a process of its own: the agent never runs a torch op (the zygote that forks the
workers must fork before any, and the agent's memory stays small); the check's
``import torch`` is part of what a preflight costs (``preflight_s``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from typing import Any

__all__ = ["main"]


def _measure(
    addr: str, rank: int, n: int, reps: int, mb: float, timeout_s: float
) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    matmul_s = min(times)
    host, _, port = addr.rpartition(":")
    store = TCPStore(host, int(port), 2, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    pg: Any = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))  # a Backend
    x = torch.ones(max(1, int(mb * 1024 * 1024 / 4)))
    pg.allreduce([x]).wait()  # warm-up: the connection
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pg.allreduce([x]).wait()
        times.append(time.perf_counter() - t0)
    pg.barrier().wait()  # rank 0's store must outlive rank 1's last read
    return {"matmul_s": matmul_s, "allreduce_s": min(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stalwart.agent.health._preflight_round")
    p.add_argument("addr")
    p.add_argument("rank", type=int, choices=(0, 1))
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    try:
        out: dict[str, object] = {
            "v": 1,
            **_measure(args.addr, args.rank, args.n, args.reps, args.mb, args.timeout),
        }
    except Exception as err:  # the agent reads the line: a failed check is a verdict
        out = {"v": 1, "error": f"{type(err).__name__}: {err}"[:500]}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
