"""The one place a strategy name becomes a :class:`~stalwart.agent.policy.RecoveryPolicy`."""

from __future__ import annotations

from stalwart.agent._async import ReplicaGroups
from stalwart.agent._elastic import ElasticPolicy, Joins
from stalwart.agent._inplace import InPlace
from stalwart.agent._restart import RestartAll
from stalwart.agent.policy import RecoveryParts, RecoveryPolicy
from stalwart.contract.env import Strategy

__all__ = ["choose_policy"]


def choose_policy(strategy: Strategy, parts: RecoveryParts, joins: Joins) -> RecoveryPolicy:
    """The policy of ``--strategy`` (parsed by the config)."""
    if strategy is Strategy.RESTART:
        return RestartAll(parts)
    if strategy is Strategy.ELASTIC:
        return ElasticPolicy(parts, joins)
    if strategy is Strategy.ASYNC:
        return ReplicaGroups(parts)
    return InPlace(parts, name=strategy.value, assigns_spares=strategy.uses_spares)
