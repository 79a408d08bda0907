"""What the agent does about an incident: one recovery policy per ``--strategy``.

Each strategy is a :class:`~stalwart.agent.strategies.policy.RecoveryPolicy` acting
through the same :class:`~stalwart.agent.strategies.policy.RecoveryParts`:
:class:`RestartAll` (``restart``, and every plain script: torchrun's route),
:class:`InPlace` (``flash``, ``spare``: the failed rank is replaced in place),
:class:`ElasticPolicy` (``elastic``: the job goes on without the failed member, and grows
back when it or a new node joins; a sharded job resizes by restarts) and
:class:`ReplicaGroups` (``async``: a failed replica group is dropped from the rounds and
restarted). :func:`choose_policy` is the one place a strategy name becomes one of them.
"""

from __future__ import annotations

from stalwart.agent.strategies._async import ReplicaGroups
from stalwart.agent.strategies._elastic import ElasticPolicy, Joins
from stalwart.agent.strategies._inplace import InPlace
from stalwart.agent.strategies._restart import RestartAll
from stalwart.agent.strategies.policy import RecoveryParts, RecoveryPolicy
from stalwart.contract.env import Strategy

__all__ = ["ElasticPolicy", "InPlace", "ReplicaGroups", "RestartAll", "choose_policy"]


def choose_policy(strategy: Strategy, parts: RecoveryParts, joins: Joins) -> RecoveryPolicy:
    """The policy of ``--strategy`` (parsed by the config)."""
    if strategy is Strategy.RESTART:
        return RestartAll(parts)
    if strategy is Strategy.ELASTIC:
        return ElasticPolicy(parts, joins)
    if strategy is Strategy.ASYNC:
        return ReplicaGroups(parts)
    return InPlace(parts, name=strategy.value, assigns_spares=strategy.uses_spares)
