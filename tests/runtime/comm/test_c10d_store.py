"""CoordStoreC10d: torch's Store interface over the coordinator's store, as gloo uses it."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore

from stalwart.coordinator import MemoryStore
from stalwart.runtime.comm._c10d_store import CoordStoreC10d


def test_store_operations() -> None:
    mem = MemoryStore()
    s = CoordStoreC10d(mem, "/j/c10d/", timedelta(seconds=5))
    s.set("a", b"1")
    assert s.get("a") == b"1"
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    assert s.compare_set("c", b"", b"x") == b"x"  # absent + empty expectation: set
    assert s.compare_set("c", b"y", b"z") == b"x"  # mismatch: the current value
    assert s.compare_set("c", b"x", b"z") == b"z"
    assert s.compare_set("gone", b"y", b"z") == b"y"  # absent, non-empty expectation
    assert s.check(["a", "c"]) and not s.check(["missing"])
    assert s.num_keys() == 3
    assert s.delete_key("a") and not s.delete_key("a")
    with pytest.raises(Exception, match="not set within"):
        s.wait(["never"], timedelta(milliseconds=50))
    assert all(kv.key.startswith("/j/c10d/") for kv in mem.range("").kvs)


def test_gloo_group_forms_over_it() -> None:
    mem = MemoryStore()
    out: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        # keep the Python object alive: torch holds only its C++ side (pybind11)
        base = CoordStoreC10d(mem, "/j/c10d/", timedelta(seconds=30))
        pg = dist.ProcessGroupGloo(PrefixStore("job/gen3", base), r, 3, timedelta(seconds=30))
        t = torch.full((4,), float(r + 1))
        pg.allreduce([t]).wait()
        out[r] = t

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(out) == [0, 1, 2]
    assert all(torch.equal(t, torch.full((4,), 6.0)) for t in out.values())
