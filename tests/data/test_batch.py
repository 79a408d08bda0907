"""The global batch policy, on hand-computed cases."""

from __future__ import annotations

import pytest

from stalwart.data import BatchConfig, BatchPlan, compatible_global_batch, plan_batch
from stalwart.errors import ConfigError


@pytest.mark.parametrize(
    ("world", "per_rank", "micro"),
    [
        (4, 8, 3),  # 96 / 4 = 24 per rank = 3 x 8
        (3, 8, 4),  # 32 per rank = 4 x 8
        (2, 8, 6),  # 48 = 6 x 8
        (8, 6, 2),  # 12 per rank: 2 x 8 would overshoot, 2 equal parts of 6
        (6, 8, 2),
        (1, 8, 12),
    ],
)
def test_exact_keeps_the_global_batch(world: int, per_rank: int, micro: int) -> None:
    plan = plan_batch(BatchConfig(global_batch=96, micro_batch=8), world)
    assert plan == BatchPlan(world, 0, per_rank, micro, 96, 1.0)


def test_exact_splits_into_equal_micro_batches() -> None:
    # 20 per rank with at most 8: 3 parts would be uneven (7, 7, 6) -> 4 parts of 5
    assert plan_batch(BatchConfig(global_batch=40, micro_batch=8), 2).per_rank_batch == 5


def test_exact_refuses_a_non_divisor_up_front_and_at_plan_time() -> None:
    cfg = BatchConfig(global_batch=96, micro_batch=8)
    cfg.validate(2, 4)
    with pytest.raises(ConfigError, match=r"not divisible by world size 5 .*'compatible'"):
        cfg.validate(2, 8)
    with pytest.raises(ConfigError, match="not divisible by world size 5"):
        plan_batch(cfg, 5)


def test_compatible_trains_the_largest_compatible_size_and_parks_the_rest() -> None:
    cfg = BatchConfig(global_batch=96, micro_batch=8, policy="compatible")
    assert plan_batch(cfg, 5, min_world=2) == BatchPlan(4, 1, 8, 3, 96, 1.0)
    assert plan_batch(cfg, 7, min_world=2) == BatchPlan(6, 1, 8, 2, 96, 1.0)
    listed = BatchConfig(96, 8, policy="compatible", world_sizes=(2, 8))
    assert plan_batch(listed, 7).world_size == 2
    cfg.validate(2, 8)
    with pytest.raises(ConfigError, match="no compatible world size at the minimum 5"):
        cfg.validate(5, 8)
    with pytest.raises(ConfigError, match="world size 5 in world_sizes does not divide"):
        BatchConfig(96, 8, policy="compatible", world_sizes=(4, 5))


def test_nearest_scales_the_learning_rate() -> None:
    cfg = BatchConfig(global_batch=96, micro_batch=8, policy="nearest")
    # 5 ranks: 96 / (5 x 8) -> 3 micro-batches; 96 / 15 = 6.4 -> 6 per micro-batch; 90
    assert plan_batch(cfg, 5) == BatchPlan(5, 0, 6, 3, 90, 90 / 96)
    # 7 ranks: 96 / 56 -> 2 micro-batches; 96 / 14 = 6.86 -> 7; 98
    assert plan_batch(cfg, 7) == BatchPlan(7, 0, 7, 2, 98, 98 / 96)
    assert plan_batch(cfg, 4) == BatchPlan(4, 0, 8, 3, 96, 1.0)  # divisible: unchanged
    assert plan_batch(cfg, 5).event_fields(0.1) == {
        "world_size": 5,
        "micro_batches": 3,
        "lr": pytest.approx(0.1 * 90 / 96),
        "global_batch": 90,
    }
    sqrt = plan_batch(BatchConfig(100, 100, policy="nearest", lr_scaling="sqrt"), 3)
    assert sqrt.global_batch == 99 and sqrt.lr_scale == pytest.approx((99 / 100) ** 0.5)


def test_compatible_global_batch_picks_the_most_divisible() -> None:
    # sizes 2..4, micro 4: 48 serves 2, 3, 4 (24, 16, 12 per rank, all multiples of 4)
    assert compatible_global_batch(50, (4,), 2, 4) == (48, [2, 3, 4])


def test_impossible_configurations_are_one_line_errors() -> None:
    for bad in (
        lambda: BatchConfig(global_batch=0, micro_batch=8),
        lambda: BatchConfig(global_batch=8, micro_batch=8, policy="bogus"),  # type: ignore[arg-type]
        lambda: BatchConfig(8, 8, lr_scaling="cubic"),  # type: ignore[arg-type]
        lambda: plan_batch(BatchConfig(8, 8), 0),
        lambda: compatible_global_batch(2, (4,), 3, 3),
        lambda: BatchConfig(8, 8).validate(3, 2),
    ):
        with pytest.raises(ConfigError) as info:
            bad()
        assert "\n" not in str(info.value)
