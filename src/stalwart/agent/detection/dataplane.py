"""A watched data plane: every local rank waits in a collective and nothing moves.

A worker waiting in a collective is never judged hung by itself (agent/detection/hang.py): it
waits for a peer, and the peer's own agent judges that peer. That leaves one fault
nobody judges: the data plane between nodes is cut while each node still reaches the
store (etcd on a third host, the embedded store behind another link), so every lease
stays valid, every worker of the job waits in a gloo collective for a peer it will
never hear from, and every agent sees only patient waiters. torchrun leaves it to the
collective timeout (30 min); a partition must instead be found within seconds.

So when every local rank waits in a collective and no rank of the job moved for longer
than the hang floor (:func:`find_stall`: ``--hang-floor``, whatever the
step time), the agent probes every live peer agent directly, not through the store
(agent/cluster/_peerwatch.py: the same authenticated hello as the peer watch, over the nodes'
own network). :func:`decide` turns the answers into who is fenced:

- every peer answered: the data plane between the agents is whole; the culprit is a
  slow step or a hung rank on another node, whose agent judges it (nothing to fence
  here). So the probe, not the step time, tells a cut from a slow peer: the step time
  grows under load and with it any bound learned from it (a permanent partition under
  elastic and etcd was found after 104.8 s at load 35 when the probe waited 3 x p99);
- this node's side (itself and the peers it reached) holds a strict majority of the
  live nodes, or exactly half and the node that holds rank 0 (the coordinator): it
  wins, and the node holding rank 0 on it revokes the leases of the nodes it could not
  reach, which then recover as lost nodes (their ranks adopted, the generation bumped
  under the lease guard, coordinator/fence.py);
- otherwise it lost: it revokes its own lease, so it is fenced (agent/cluster/_fencing.py:
  its workers are stopped, it exits 3) even if the winners cannot reach the store.

Why only the side holding rank 0's node revokes others: a partition that is not
transitive (A reaches B, B reaches C, A does not reach C) gives both A and C a
"majority" with B; were both to revoke, both would be fenced. Exactly one side holds
rank 0's node, so at most one side fences others, and a minority always fences itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stalwart.agent.detection.hang import Activity, HangConfig
from stalwart.contract.board import Slot

__all__ = ["Cut", "Stall", "decide", "find_stall"]


@dataclass(frozen=True)
class Stall:
    """Every local rank waits in a collective with no progress: the data plane may be cut."""

    ranks: list[int]
    stalled_s: float  # since the job last moved (a step done, a recovery began): the
    # fault's age, while the bound is judged on the time nobody here computed either
    threshold_s: float  # the bound it passed (the hang floor)


def find_stall(
    slots: Mapping[int, Slot],
    now: float,
    config: HangConfig,
    activity: Mapping[int, Activity],
    *,
    since: float = 0.0,
) -> Stall | None:
    """``slots``/``activity``/``since`` as for :func:`~stalwart.agent.detection.hang.find_hang`.
    A stall: every live local rank runs the stalwart runtime and its phase says it waits
    in a collective, and none progressed for longer than ``config.floor_s``. Neither a
    bound learned from the step time nor the ranks' CPU: a stall only starts the probe,
    and a peer that answers it is not cut (module docstring). Ranks blocked in a cut
    collective show a CPU blip every second or two (a thread of theirs, on a loaded
    machine; measured across two hosts), and a long CPU allreduce computes in the
    collective: neither is a reason not to ask the peers."""
    watched = {r: s for r, s in slots.items() if r in activity}
    if not watched or any(not s.attached or s.phase != "collective" for s in watched.values()):
        return None
    threshold = config.floor_s
    moved = max(since, *(s.t_progress for s in watched.values()))
    if now - moved <= threshold:
        return None
    return Stall(sorted(watched), now - moved, threshold)


@dataclass(frozen=True)
class Cut:
    """What this node does about the nodes it could not reach."""

    fence_self: bool
    """This node is on the losing side: it revokes its own lease (fenced, exit 3)."""
    fence: tuple[int, ...]
    """Nodes whose leases this node revokes (only ever the side holding rank 0's node)."""
    unreachable: tuple[int, ...]
    """The live nodes this node's probe did not reach."""
    how: str
    """One line for the event and the log: who is cut and what this node does."""


def decide(node: int, live: set[int], reached: set[int], holder: int) -> Cut | None:
    """``node``: this node; ``live``: the live member nodes (this one included);
    ``reached``: the peers that answered the probe; ``holder``: the node holding rank
    0 (the tie-break). None when every live peer answered (nothing is cut between the
    agents)."""
    side = ({node} | reached) & (live | {node})
    cut = tuple(sorted((live | {node}) - side))
    if not cut:
        return None
    everyone = len(side) + len(cut)
    won = 2 * len(side) > everyone or (2 * len(side) == everyone and holder in side)
    sides = f"this side {sorted(side)} of {everyone} nodes, cut from {list(cut)}"
    if not won:
        why = "a minority" if 2 * len(side) < everyone else "half without rank 0's node"
        how = f"data plane cut: {sides}; {why}, so this node fences itself"
        return Cut(True, (), cut, how)
    if node != holder and holder in side:
        how = f"data plane cut: {sides}; this side wins, node {holder} fences the rest"
        return Cut(False, (), cut, how)
    if holder not in side:
        how = f"data plane cut: {sides}; a majority without rank 0's node: it fences itself"
        return Cut(False, (), cut, how)
    how = f"data plane cut: {sides}; this side wins (it holds rank 0), fencing {list(cut)}"
    return Cut(False, cut, cut, how)
