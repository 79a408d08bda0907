"""The one place a strategy name becomes a :class:`~stalwart.agent.policy.RecoveryPolicy`."""

from __future__ import annotations

from stalwart.agent._elastic import ElasticPolicy, Joins
from stalwart.agent._inplace import InPlace
from stalwart.agent._restart import RestartAll
from stalwart.agent.policy import RecoveryParts, RecoveryPolicy

__all__ = ["choose_policy"]


def choose_policy(strategy: str, parts: RecoveryParts, joins: Joins) -> RecoveryPolicy:
    """The policy of ``--strategy`` (validated by the config: one of STRATEGIES)."""
    if strategy == "restart":
        return RestartAll(parts)
    if strategy == "elastic":
        return ElasticPolicy(parts, joins)
    return InPlace(parts, name=strategy, assigns_spares=strategy == "spare")
