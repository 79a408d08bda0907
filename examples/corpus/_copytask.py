"""The toy data the Transformers-style corpus scripts train on (hf_gpt2.py, hf_trainer.py,
accelerate_loop.py): a dataset like any ``Dataset`` of token dicts a user would write.

Sequences that repeat their first half, so a small GPT-2's loss falls within a few dozen
steps; sample ``i`` is a function of ``(salt, i)`` alone, so every rank and every restart
reads the same bytes for the same index. ``index`` rides along in each sample for the
trace (which samples a step read): the train split (salt 1) records ``i``, any other split
``-1 - i`` (negative: an eval sample is never mistaken for a train one).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class CopyTask(Dataset[dict[str, torch.Tensor]]):
    """Sequences that repeat their first half: sample i is a function of i."""

    def __init__(self, n: int, seq: int, vocab: int, salt: int) -> None:
        self.n, self.seq, self.vocab, self.salt = n, seq, vocab, salt

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.salt * 100_003 + i)
        half = torch.randint(1, self.vocab, (self.seq // 2,), generator=g)
        ids = torch.cat([half, half])
        index = i if self.salt == 1 else -1 - i
        return {"input_ids": ids, "labels": ids.clone(), "index": torch.tensor(index)}
