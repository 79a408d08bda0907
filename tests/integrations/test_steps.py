"""integrations/_steps.py: the step transaction driven from a framework's hooks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stalwart.integrations._steps import Rewind, StepDriver

from ._fake import FakeSession


class Counter:
    """A tracked object: one number, rolled back with the step."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def _driver(sess: FakeSession) -> tuple[StepDriver, Counter]:
    c = Counter()
    sess.track(counter=c)
    return StepDriver(sess), c  # type: ignore[arg-type]


def test_a_fault_free_run_hands_out_each_step_once_and_finishes() -> None:
    sess = FakeSession()
    d, c = _driver(sess)
    d.start(3)
    d.train_begin(0)
    for done in range(3):
        assert d.begin(done) == done + 1
        c.n += 1
    d.finish(3)
    assert d.finished and sess.yielded == [1, 2, 3] and c.n == 3


def test_a_failed_step_rewinds_to_the_restored_step_and_redoes_the_rest() -> None:
    sess = FakeSession(fail_at={3: 1})  # step 3 fails: the state is back at step 1
    d, c = _driver(sess)
    d.start(4)
    d.train_begin(0)
    done = 0
    with pytest.raises(Rewind) as r:
        while True:
            assert d.begin(done) == done + 1
            c.n += 1
            done += 1
    assert r.value.step == 1 and c.n == 1  # the counter is step 1's again
    d.train_begin(1)  # the framework's loop re-entered at step 1
    for done in range(1, 4):
        assert d.begin(done) == done + 1
        c.n += 1
    d.finish(4)
    assert d.finished and c.n == 4 and sess.yielded == [1, 2, 3, 2, 3, 4]


def test_a_redone_step_draws_the_random_numbers_the_first_attempt_drew() -> None:
    """The re-entered loop draws while it opens its iterator: begin() puts the restored
    RNGs back, so the redone step sees what the fault-free one saw."""
    sess = FakeSession(fail_at={2: 1})
    d, _ = _driver(sess)
    d.start(3)
    d.train_begin(0)
    d.begin(0)
    d.begin(1)
    first = torch.rand(4)  # step 2's draw
    with pytest.raises(Rewind):
        d.begin(2)
    torch.rand(7)  # the re-entered loop's own draws (a DataLoader iterator, a skip)
    d.train_begin(1)
    assert d.begin(1) == 2
    assert torch.equal(torch.rand(4), first)


def test_a_rewind_to_step_0_puts_the_rngs_back_at_train_begin() -> None:
    sess = FakeSession(fail_at={1: 0})
    d, _ = _driver(sess)
    d.start(2)
    d.train_begin(0)
    first = torch.rand(3)  # the epoch's iterator, opened after train begin
    d.begin(0)
    with pytest.raises(Rewind) as r:
        d.begin(1)
    assert r.value.step == 0
    torch.rand(5)
    d.train_begin(0)
    assert torch.equal(torch.rand(3), first)


def test_a_job_resumed_past_step_0_rewinds_at_start() -> None:
    sess = FakeSession(start_at=5)
    d, _ = _driver(sess)
    with pytest.raises(Rewind) as r:
        d.start(8)
    assert r.value.step == 5
    d.train_begin(5)
    assert d.begin(5) == 6


def test_a_pause_opened_at_step_end_lasts_until_the_next_step_begins() -> None:
    sess = FakeSession()
    d, _ = _driver(sess)
    d.start(2)
    d.train_begin(0)
    d.begin(0)
    d.pause("eval")
    d.pause("save")  # one pause at a time: the eval's covers the save after it
    assert sess.open_pauses == 1 and sess.pauses == ["eval"]
    d.begin(1)
    assert sess.open_pauses == 0
    d.pause("eval")
    d.finish(2)
    assert sess.open_pauses == 0 and d.finished


def test_recover_after_a_failed_collective_outside_the_compute() -> None:
    """An eval's gather raised StepFailedError: the step is redone from the restored one."""
    sess = FakeSession(fail_at={2: 1})
    d, c = _driver(sess)
    d.start(3)
    d.train_begin(0)
    d.begin(0)
    c.n += 1
    d.begin(1)
    c.n += 1
    d.pause("eval")
    assert d.recover() == 1 and c.n == 1 and sess.open_pauses == 0
    d.train_begin(1)
    assert d.begin(1) == 2


def test_a_broken_finish_rewinds_and_the_run_finishes_after() -> None:
    sess = FakeSession(fail_at={2: 1})  # the last step fails at the finish
    d, _ = _driver(sess)
    d.start(2)
    d.train_begin(0)
    d.begin(0)
    d.begin(1)
    with pytest.raises(Rewind) as r:
        d.finish(2)
    assert r.value.step == 1 and not d.finished
    d.train_begin(1)
    assert d.begin(1) == 2
    d.finish(2)
    assert d.finished
