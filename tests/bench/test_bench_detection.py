"""bench/detection.py's straggler figures as a distribution over repetitions (in process,
scripted repetitions): the rate found, the latency's p95, false positives per hour."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def test_detection_rate_p95_and_false_positives_per_hour(harness: ModuleType) -> None:
    import detection

    reps: list[dict[str, Any]] = [
        {"straggler_detect_s_1p5x": None, "straggler_detect_s_3x": 2.0,
         "straggler_false_positives": 1, "straggler_fault_free_s": 1800.0},
        {"straggler_detect_s_1p5x": 30.0, "straggler_detect_s_3x": 3.0,
         "straggler_false_positives": 0, "straggler_fault_free_s": 1800.0},
        {"straggler_detect_s_1p5x": 50.0, "straggler_detect_s_3x": 9.0,
         "straggler_false_positives": 0, "straggler_fault_free_s": 1800.0},
    ]  # fmt: skip
    summary = harness.repeat(lambda rep: reps[rep], 3, load=lambda: 2.0, log=lambda line: None)
    rates = detection.straggler_rates(summary)
    assert rates["straggler_detected_1p5x"] == "2/3"
    assert rates["straggler_detected_3x"] == "3/3"
    assert rates["straggler_detect_s_3x_p95"] == 9.0
    assert rates["straggler_false_positives_per_hour"] == 1 / 1.5
    doc = summary.document(rates)
    assert doc["straggler_detect_s_1p5x"] == 40.0  # the median of the two it found
