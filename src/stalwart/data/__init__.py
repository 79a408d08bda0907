"""Data: a resumable, reshardable loader and the global batch policy.

``stalwart.data.loader(dataset, batch_size=32)`` replaces a DataLoader + sampler: its
state (seed, epoch, position in the epoch's global permutation) is checkpointed with the
rest of the training state, and a world-size change re-partitions what is left of the
epoch (no sample seen twice or skipped). See docs/data.md.

``stalwart.data.epoch_batches(dataloader)`` keeps a script's own ``DistributedSampler`` +
``DataLoader`` (and their order) and makes them resumable mid-epoch (docs/porting.md).
"""

from __future__ import annotations

from stalwart.data.batch import BatchConfig, BatchPlan, Policy, compatible_global_batch, plan_batch
from stalwart.data.elastic import LR_SCALE_KEY, apply_plan
from stalwart.data.epochs import EpochBatches, epoch_batches, rest_of_epoch
from stalwart.data.loader import Loader, loader
from stalwart.data.sampler import Round, SamplerState, Tail, epoch_permutation

__all__ = [
    "LR_SCALE_KEY",
    "BatchConfig",
    "BatchPlan",
    "EpochBatches",
    "Loader",
    "Policy",
    "Round",
    "SamplerState",
    "Tail",
    "apply_plan",
    "compatible_global_batch",
    "epoch_batches",
    "epoch_permutation",
    "loader",
    "plan_batch",
    "rest_of_epoch",
]
