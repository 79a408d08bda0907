"""A fenced worker is never silent: it says so in one line, then rejoins or exits.

Two ways a worker learns it is fenced. A checkpoint commit refused as fenced (the job's
generation moved past the one it trained in): the worker leaves its generation at the
next step boundary, as when its generation watch fires, and rejoins the current one.
A join or a generation bump refused because its agent's lease is gone (its node was cut
from the coordinator; its ranks run elsewhere now): the worker exits with
:data:`FENCED_EXIT`, which its agent, fenced too, reports as the node's exit 3.
Either way one line on stderr names the rank and why; a step is never trained on in a
generation the job has left while the member stays quiet about it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

from stalwart.errors import FencedError
from stalwart.logs import get_logger

__all__ = ["FENCED_EXIT", "CommitRefusals", "stop_if_fenced"]

FENCED_EXIT = 3
"""A worker's exit code when it stops fenced (the agent's is 3 too: docs/launch.md)."""


_say = get_logger(__name__).error  # "stalwart: runtime: error: ...", one line on stderr


@contextlib.contextmanager
def stop_if_fenced(rank: Callable[[], int]) -> Iterator[None]:
    """Around a join or a bump: a FencedError ends this worker with one line and
    :data:`FENCED_EXIT` (a SystemExit: no traceback, the script's ``finally`` runs)."""
    try:
        yield
    except FencedError as err:
        first = str(err).splitlines()[0] if str(err) else "its lease is gone"
        _say(f"rank {rank()} stops, fenced: {first}")
        raise SystemExit(FENCED_EXIT) from None


class _Position(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def generation(self) -> int: ...


class CommitRefusals:
    """What the session does with a commit refused as fenced (runtime/steps/_accounting.py
    reports it from its persist thread): say so once per generation, and leave the
    generation at the next step boundary (``leave``: the generation watch's flag)."""

    def __init__(self, position: _Position, leave: Callable[[], None]) -> None:
        self._position, self.leave = position, leave
        self._said: set[int] = set()

    def refused(self, err: BaseException, step: int, generation: int) -> None:
        if not isinstance(err, FencedError):
            return
        if generation not in self._said:
            self._said.add(generation)
            first = str(err).splitlines()[0] if str(err) else "fenced"
            _say(
                f"rank {self._position.rank}: the checkpoint of step {step} was refused "
                f"(generation {generation} is fenced: {first}); leaving it to rejoin"
            )
        if generation == self._position.generation:  # not a persist of a generation we left
            self.leave()
