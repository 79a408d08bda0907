"""The report's bucket tier section: per remote tier (``stalwart run --ckpt-tier URL``),
the steps committed there, the newest, the mean upload time and the lag behind the local
commit (``tier_commit`` events, node 0's uploader; docs/checkpoint-storage.md).

Why apart from the local checkpoint figures: each tier is acknowledged on its own (the
local disk first, the bucket later), so a bucket that falls behind shows as its own lag
rather than hiding inside the persist time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stalwart.metrics.events import Event

__all__ = ["tier_lines", "tier_section"]


def tier_section(events: Sequence[Event]) -> dict[str, dict[str, float | int]]:
    """Per bucket tier: steps committed there, the newest, the mean upload time, the mean
    and largest lag behind the local commit."""
    commits = [e for e in events if e.kind == "tier_commit"]
    out: dict[str, dict[str, float | int]] = {}
    for tier in sorted({str(e["tier"]) for e in commits}):
        mine = [e for e in commits if e["tier"] == tier]
        lags = [float(e["lag_s"]) for e in mine]
        out[tier] = {
            "commits": len(mine),
            "last_step": max(int(e["step"]) for e in mine),
            "upload_s_mean": sum(float(e["seconds"]) for e in mine) / len(mine),
            "lag_s_mean": sum(lags) / len(lags),
            "lag_s_max": max(lags),
        }
    return out


def tier_lines(tiers: dict[str, Any], safe: Callable[[Any], str]) -> list[str]:
    """The summary's lines of :func:`tier_section`'s document (``safe`` escapes text
    that came from the event log)."""
    return [
        f"  tier {safe(tier)}: {x['commits']} step(s) committed, newest {x['last_step']}, "
        f"upload {x['upload_s_mean']:.2f} s mean, lag {x['lag_s_mean']:.2f} s mean "
        f"{x['lag_s_max']:.2f} s max"
        for tier, x in tiers.items()
    ]
