"""A coordinator member in its own process, driven line by line over stdin/stdout.

Used by test_etcd.py to simulate a network partition with SIGSTOP: the whole
process (heartbeat thread included) freezes for longer than its lease, exactly
like an agent cut off from etcd. Commands: ``commit GEN STEP``, ``lost``,
``rejoin``, ``exit``; each gets one reply line.
"""

from __future__ import annotations

import sys

from stalwart.coordinator import Coordinator, CoordinatorConfig, CoordinatorError
from stalwart.coordinator.etcd import EtcdStore, EtcdStoreConfig
from stalwart.errors import FencedError


def main(address: str) -> None:
    """``address``: a plain etcd's port on loopback, or an ``etcds://`` URL."""
    config = EtcdStoreConfig(reconnect_timeout=10)
    if address.isdigit():
        store = EtcdStore([("127.0.0.1", int(address))], "/t/", config)
    else:
        store = EtcdStore.from_url(address, config)
    coord = Coordinator(store, CoordinatorConfig(job_id="job", lease_ttl=1, heartbeat_interval=0.2))
    member = coord.join("a")
    member.start_heartbeat()
    print("joined", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        reply = "ok"
        try:
            if cmd == "commit":
                coord.commit_step(int(args[0]), int(args[1]), by="a")
            elif cmd == "lost":
                reply = type(member.lost).__name__
            elif cmd == "rejoin":
                member.leave()
                member = coord.join("a")
                member.start_heartbeat()
            elif cmd == "exit":
                break
        except FencedError as exc:
            reply = f"fenced {exc}"
        except CoordinatorError as exc:
            reply = f"error {type(exc).__name__}: {exc}"
        print(reply, flush=True)
    member.leave()
    store.close()
    print("bye", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
