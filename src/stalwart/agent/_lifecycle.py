"""The two ends of an agent's life: the run's start records and the teardown.

Teardown order matters: workers are stopped before ``run_end`` is written (so the record
follows every worker event), the goodbye (``agents-done``) is written before the watched
connection and the store go away (so no peer mistakes a clean end for a node loss), and
shared memory is removed last, once nothing maps it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import TYPE_CHECKING, Any

from stalwart.checkpoint.slots import SlotNames

if TYPE_CHECKING:
    from stalwart.agent.agent import Agent

__all__ = ["emit_run_start", "preload_note", "teardown"]


def preload_note(agent: Agent, ready: dict[str, Any]) -> None:
    """Say once (node 0) what of the script's imports the zygote could not preload: the
    workers import those themselves, and each replacement pays for them again."""
    pre = ready.get("preload") or {}
    failed = [str(x) for x in pre.get("failed", [])]
    note = str(pre.get("note", ""))
    if agent.cfg.node_rank != 0 or not (failed or note):
        return
    what = note or f"could not preload {'; '.join(failed)}"
    agent.say(f"{what}; replacement workers import them again (slower recovery)")


def emit_run_start(agent: Agent, ready: dict[str, Any]) -> None:
    cfg = agent.cfg
    agent.events.emit(
        "run_start",
        job=cfg.job,
        world_size=cfg.world_size,
        nnodes=cfg.nnodes,
        strategy=cfg.strategy,
        config={
            "script": cfg.script,
            "nproc_per_node": cfg.nproc_per_node,
            "max_restarts": cfg.max_restarts,
            "spares": cfg.spares,
            "chaos": cfg.chaos or "",
            "zygote_import_s": ready.get("import_s", 0.0),
            "preloaded": list((ready.get("preload") or {}).get("imported", [])),
            "hang_floor_s": cfg.hang.floor_s,
            "hang_k": cfg.hang.k,
        },
    )
    agent.events.emit(
        "generation", generation=agent.generation, world_size=cfg.world_size, reason="start"
    )


def teardown(agent: Agent) -> None:
    with contextlib.suppress(Exception):
        agent._stop_all("shutdown", timeout=5.0)
    if agent.standbys is not None:
        agent.standbys.close()
    agent.trash.close()
    replicas = getattr(agent, "replicas", None)
    if replicas is not None:
        replicas.close()
    chaos = getattr(agent, "chaos", None)  # (none if the agent ended before it started)
    if chaos is not None:
        with contextlib.suppress(Exception):
            chaos.report_unfired()  # a warning per chaos fault that never fired
    with contextlib.suppress(Exception):
        agent.step_records.close()  # before run_end: the last steps belong to the run
    if agent.cluster.reports_end():
        agent.events.emit(
            "run_end",
            status=agent.status,
            last_step=agent.last_step(),
            reason=getattr(agent, "_end_reason", ""),
        )
    if agent._live is not None:
        with contextlib.suppress(Exception):
            agent._live.close()
    if agent._zygote is not None:
        agent._zygote.close()
    agent.cluster.close(goodbye=agent._goodbye)
    if agent._board is not None:
        agent._board.close(unlink=True)
    # only a member's ranks are its own: an agent the job refused at the start (its node
    # lost and blocklisted, then started again) owns none, and on one host the node that
    # adopted them uses the same slot names (bench/soak.py found it deleting them)
    joined = getattr(agent, "coord", None) is not None  # set once cluster.start() joined
    if agent.cluster.started:  # (one that ended before the run id was agreed made none)
        ranks = list(agent.workers) if joined else []
        _remove_shm(agent.cluster.names, ranks, everything=agent.cluster.last_out)
    agent.events.close()


def _remove_shm(names: SlotNames, ranks: list[int], *, everything: bool) -> None:
    """This node's ranks' slots; ``everything``: the last agent out on this host also
    removes what lost nodes left (only this run's names: another job is not touched)."""
    for rank in ranks:
        shutil.rmtree(names.rank_dir(rank), ignore_errors=True)
    for path in names.everything() if everything else []:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
