"""bench/_scale_peers.py: the torchrun peer names its rendezvous events as torch does
(``dynamic_rendezvous.get_method_name``: ``inspect.stack()[depth].function``), from the
frame instead of from a stack with every frame's source read."""

from __future__ import annotations

import inspect


def test_the_event_name_is_the_one_torch_takes_from_the_stack() -> None:
    from _scale_peers import _frame_name

    def get_method_name(depth: int = 2) -> str:  # torch's
        return inspect.stack()[depth].function

    def record() -> tuple[str, str]:  # torch's _record calls get_method_name()
        return _frame_name(), get_method_name()

    def next_rendezvous() -> tuple[str, str]:
        return record()

    ours, torchs = next_rendezvous()
    assert ours == torchs == "next_rendezvous"
