"""The receiving side's slots: one :class:`Target` per namespace (its slot files and
the lock that lets one transfer at a time write into them), and the checks a received
copy must pass (layout inside the data, chunk checksums)."""

from __future__ import annotations

import threading

from stalwart.checkpoint.format import checksum
from stalwart.checkpoint.slots import SlotFiles, SlotMeta, Window, pinned_slots
from stalwart.transfer.errors import TransferError

__all__ = ["Target", "hash_window", "layout_fits", "mismatch"]


class Target:
    """The slots of one namespace; one transfer at a time writes into them."""

    def __init__(self, directory: str, slots: int) -> None:
        self.lock = threading.Lock()
        self.directory = directory
        self.slots = [SlotFiles(directory, i) for i in range(slots)]

    def choose(self) -> SlotFiles:
        """An empty slot, else the oldest complete one; never one that a reader (a
        persist of the received copy, a restore, a transfer onwards) has pinned."""
        pinned = pinned_slots(self.directory)
        free = [s for s in self.slots if s.index not in pinned]
        if not free:
            raise TransferError(
                f"every slot of {self.directory} is pinned by a reader; retry when it is done"
            )
        metas = {s.index: s.read_meta() for s in free}
        return min(free, key=lambda s: (metas[s.index] is not None, _seq(metas[s.index])))


def _seq(meta: SlotMeta | None) -> int:
    return -1 if meta is None else meta.seq


def hash_window(window: Window) -> str:
    """The xxh3 of a received chunk; its mapping is closed after."""
    try:
        return checksum(window.view)
    finally:
        window.close()


def layout_fits(meta: SlotMeta, size: int) -> bool:
    try:
        return all(
            0 <= int(e["offset"]) <= int(e["offset"]) + int(e["nbytes"]) <= size
            for e in meta.layout
        )
    except (KeyError, TypeError, ValueError):
        return False


def mismatch(bad: list[int], chunk: int, size: int) -> str:
    first = bad[0]
    end = min(size, (first + 1) * chunk)
    more = f" and {len(bad) - 1} more ({', '.join(map(str, bad[1:6]))}...)" if len(bad) > 1 else ""
    return (
        f"chunk {first} (bytes {first * chunk}..{end}) does not match its xxh3-128{more}; "
        "the bytes were damaged in transit or at the source; resend"
    )
