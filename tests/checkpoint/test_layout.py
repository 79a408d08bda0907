"""A step's shard layout across ranks (checkpoint/_layout.py): copies resolve to stored
pieces, boxes tile the global shape exactly; crafted layouts give one-line problems."""

from __future__ import annotations

import pytest
import torch

from stalwart.checkpoint._layout import layout_problems
from stalwart.checkpoint._load import allocate
from stalwart.checkpoint.format import ChunkRef, RankIndex, TensorEntry
from stalwart.errors import CheckpointFormatError

_PACK = "data/" + "0" * 32 + ".pack"


def _piece(offset: int, rows: int, *, glob: int = 4, copy_of: int | None = None) -> TensorEntry:
    chunks = [] if copy_of is not None else [ChunkRef("0" * 32, _PACK, 0, 4 * rows)]
    box = {"global_shape": [glob], "offsets": [offset]}
    return TensorEntry(0, "w", "float32", [rows], 4 * rows, chunks, box, copy_of)


def _step(*ranks: list[TensorEntry]) -> list[RankIndex]:
    return [RankIndex(7, r, len(ranks), None, list(t)) for r, t in enumerate(ranks)]


def test_a_good_layout_has_no_problem() -> None:
    # two shards, replicated on two more ranks (HSDP): one as bytes, one as a copy
    step = _step([_piece(0, 2)], [_piece(2, 2)], [_piece(0, 2)], [_piece(2, 2, copy_of=1)])
    assert layout_problems(step) == []


@pytest.mark.parametrize(
    ("ranks", "needle"),
    [
        (([_piece(0, 2)], [_piece(2, 2, copy_of=1)]), "copy of itself"),
        (([_piece(0, 2)], [_piece(2, 2, copy_of=0)]), "stores no piece"),
        (([_piece(0, 2, copy_of=1)], [_piece(2, 2, copy_of=0)]), "stores no piece"),  # a loop
        (([_piece(0, 3)], [_piece(2, 2)]), "overlap"),
        (([_piece(0, 2)], [_piece(3, 1)]), "missing ranks"),
        (([_piece(0, 2, glob=1 << 40)], [_piece(2, 2, glob=1 << 40)]), "missing ranks"),
        (([_piece(0, 2)], [_piece(2, 2, glob=5)]), "disagree"),
    ],
)
def test_crafted_layouts_are_one_line_problems(
    ranks: tuple[list[TensorEntry], ...], needle: str
) -> None:
    problems = layout_problems(_step(*ranks))
    assert problems and needle in problems[0], problems
    assert all("\n" not in p for p in problems)


def test_a_claim_this_host_cannot_allocate_is_a_format_error() -> None:
    with pytest.raises(CheckpointFormatError, match="cannot be allocated"):
        allocate([1 << 62, 1 << 4], torch.float32, "w")
