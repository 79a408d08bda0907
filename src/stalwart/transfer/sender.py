"""Send the newest complete shared-memory snapshot slot to a receiver.

Why it is shaped this way:

- The bytes go from the slot's mapping to the socket with ``sendall`` (no Python copy;
  measured faster than ``sendfile`` from tmpfs over loopback here), in 16 MiB chunks.
- Each chunk's xxh3-128 is computed on a helper thread *ahead* of the send (xxhash
  releases the GIL), so hashing overlaps with the kernel copy of the previous chunk.
- The source slot must not be overwritten while it is sent. The newest slot is pinned
  with a pin file that the Snapshotter honours in any process (the agent sends its
  workers' slots); a training process that pins in-process passes ``slot=``. As a last
  guard, the Snapshotter removes a slot's meta before it writes into it, so the sender
  re-reads the meta after the last byte left: the same sequence number means every byte
  sent was the complete snapshot; otherwise it aborts (SourceChangedError) and the
  receiver publishes nothing. The sender never blocks training.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from stalwart.checkpoint.format import checksum
from stalwart.checkpoint.slots import (
    SlotFiles,
    SlotMeta,
    latest_complete,
    pin_slot,
    slot_count,
    unpin_slot,
)
from stalwart.transfer import _wire
from stalwart.transfer._wire import Pacer
from stalwart.transfer.errors import (
    ChunkMismatchError,
    SourceChangedError,
    TransferError,
    TransferProtocolError,
)

__all__ = ["SendConfig", "SendResult", "complete_steps", "newest_of", "send_slot"]


@dataclass(frozen=True)
class SendConfig:
    """``rate_bytes_per_s`` caps the bandwidth (background replication); None: no cap."""

    chunk_bytes: int = 16 << 20
    rate_bytes_per_s: float | None = None
    connect_timeout_s: float = 10.0
    io_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_bytes <= 1 << 30:
            raise TransferError(f"chunk_bytes={self.chunk_bytes}: use 4 KiB .. 1 GiB")


@dataclass(frozen=True)
class SendResult:
    namespace: str  # where the receiver stored it
    slot: int  # receiver's slot index
    step: int
    seq: int
    nbytes: int
    chunks: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _slot_count(directory: str) -> int:
    try:
        return slot_count(directory)
    except FileNotFoundError:
        raise TransferError(f"no snapshot slots in {directory}; nothing to send") from None


class _Source:
    """The slot's bytes, read through mappings. An unpaced transfer (a joiner's state at a
    step boundary) maps the slot once. A paced one (replication, in the background for
    seconds at a time) maps one chunk at a time: a process's exit tears its mappings
    down before it closes its sockets, so an agent that died holding a whole slot mapped
    was seen by its buddy later (detection 0.07-0.13 s with replication vs 0.04-0.06 s
    without, bench/node_loss.py)."""

    def __init__(self, fd: int, size: int, *, per_chunk: bool) -> None:
        self._fd = fd
        self._whole: mmap.mmap | None = None
        if size and not per_chunk:
            self._whole = mmap.mmap(fd, size, prot=mmap.PROT_READ)

    @contextlib.contextmanager
    def view(self, offset: int, length: int) -> Iterator[memoryview]:
        if self._whole is not None:
            with memoryview(self._whole) as whole, whole[offset : offset + length] as part:
                yield part
            return
        mm = mmap.mmap(self._fd, length, prot=mmap.PROT_READ, offset=offset)
        try:
            with memoryview(mm) as part:
                yield part
        finally:
            mm.close()

    def close(self) -> None:
        if self._whole is not None:
            self._whole.close()
            self._whole = None


def _hash_range(source: _Source, offset: int, length: int) -> str:
    with source.view(offset, length) as part:
        return checksum(part)


def send_slot(
    address: tuple[str, int],
    token: bytes,
    source_dir: str,
    namespace: str,
    *,
    config: SendConfig | None = None,
    pacer: Pacer | None = None,
    slot: int | None = None,
    step: int | None = None,
) -> SendResult:
    """Send the newest complete slot of ``source_dir`` (a Snapshotter's slot directory)
    to the receiver at ``address``, to be stored under ``namespace`` there; with
    ``step``, the newest complete slot holding that step (pinned the same way).

    ``slot`` sends that slot instead: inside a training process, pin it first
    (``Snapshotter.pin_latest()`` ... ``unpin``) so that snapshots keep going into the
    other slot while it is sent and the transfer cannot be overtaken."""
    cfg = config or SendConfig()
    if pacer is None and cfg.rate_bytes_per_s is not None:
        pacer = Pacer(cfg.rate_bytes_per_s)
    pin: str | None = None
    if slot is None:
        found, pin = _pin_latest(source_dir, step)
    else:
        chosen = SlotFiles(source_dir, slot).read_meta()
        found = None if chosen is None else (slot, chosen)
    if found is None:
        which = f" in slot {slot}" if slot is not None else ""
        which += f" of step {step}" if step is not None else ""
        raise TransferError(f"no complete snapshot{which} of {source_dir}; take a snapshot first")
    try:
        return _send_slot(address, token, source_dir, namespace, cfg, pacer, *found)
    finally:
        if pin is not None:
            unpin_slot(pin)


def newest_of(source_dir: str, step: int | None = None) -> tuple[int, SlotMeta] | None:
    """The newest complete slot of ``source_dir`` (of ``step``, if given)."""
    return latest_complete(source_dir, _slot_count(source_dir), step)


def complete_steps(source_dir: str) -> set[int]:
    """The steps held by complete slots of ``source_dir``."""
    metas = (SlotFiles(source_dir, i).read_meta() for i in range(_slot_count(source_dir)))
    return {m.step for m in metas if m is not None}


def _pin_latest(
    source_dir: str, step: int | None = None
) -> tuple[tuple[int, SlotMeta] | None, str | None]:
    """The newest complete slot (of ``step``), pinned against the Snapshotter (in
    whatever process it runs) by a pin file. A snapshot may have chosen the slot just
    before the pin became visible: re-read its meta after pinning, and retry if it went."""
    for _ in range(5):
        found = newest_of(source_dir, step)
        if found is None:
            return None, None
        pin = pin_slot(source_dir, found[0])
        again = SlotFiles(source_dir, found[0]).read_meta()
        if again is not None and again.seq == found[1].seq:
            return found, pin
        unpin_slot(pin)
    return newest_of(source_dir, step), None  # the final seq check still guards


def _send_slot(
    address: tuple[str, int],
    token: bytes,
    source_dir: str,
    namespace: str,
    cfg: SendConfig,
    pacer: Pacer | None,
    index: int,
    meta: SlotMeta,
) -> SendResult:
    files = SlotFiles(source_dir, index)
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            src = stack.enter_context(open(files.data_path, "rb"))
            if os.fstat(src.fileno()).st_size < meta.data_size:
                raise SourceChangedError(f"{files.data_path} is shorter than its meta says; retry")
            # one chunk mapped at a time when paced (needs page-aligned chunk offsets)
            per_chunk = pacer is not None and cfg.chunk_bytes % mmap.ALLOCATIONGRANULARITY == 0
            mm = _Source(src.fileno(), meta.data_size, per_chunk=per_chunk)
            stack.callback(mm.close)
            sock = stack.enter_context(
                socket.create_connection(address, timeout=cfg.connect_timeout_s)
            )
            sock.settimeout(cfg.io_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ch = _wire.client_handshake(sock, token)
            reply = _send(
                ch,
                mm,
                files,
                meta.encode(),
                meta.seq,
                meta.data_size,
                namespace,
                cfg.chunk_bytes,
                pacer,
            )
    except OSError as err:
        raise TransferError(
            f"transfer to {address[0]}:{address[1]} failed: {err.strerror or err}; "
            "is the receiver running at that address?"
        ) from err
    return SendResult(
        namespace=str(reply["namespace"]),
        slot=int(reply["slot"]),
        step=meta.step,
        seq=meta.seq,
        nbytes=meta.data_size,
        chunks=-(-meta.data_size // cfg.chunk_bytes),
        seconds=time.perf_counter() - t0,
    )


def _send(
    ch: _wire.Channel,
    mm: _Source,
    slot: SlotFiles,
    meta_bytes: bytes,
    seq: int,
    size: int,
    namespace: str,
    chunk: int,
    pacer: Pacer | None,
) -> dict[str, Any]:
    ranges = [(o, min(chunk, size - o)) for o in range(0, size, chunk)]
    ch.send(
        {
            "type": "offer",
            "namespace": namespace,
            "data_size": size,
            "chunk_bytes": chunk,
            "chunks": len(ranges),
            "meta_bytes": len(meta_bytes),
        }
    )
    ch.send_raw(meta_bytes)
    _reply(ch.recv(("ready", "result")))
    if size:
        with ThreadPoolExecutor(1, thread_name_prefix="stalwart-xfer-hash") as pool:
            # hashing runs ahead of the sends: chunk i+1 is hashed while chunk i is sent
            hashes: list[Future[str]] = [pool.submit(_hash_range, mm, o, n) for o, n in ranges]
            try:
                for i, (o, n) in enumerate(ranges):
                    digest = hashes[i].result()
                    ch.send({"type": "chunk", "i": i, "offset": o, "length": n, "xxh3": digest})
                    _send_range(ch.sock, mm, o, n, pacer)
            finally:
                for h in hashes:
                    h.cancel()
    now = slot.read_meta()
    if now is None or now.seq != seq:
        ch.send({"type": "abort", "reason": "source slot overwritten during the transfer"})
        raise SourceChangedError(
            f"snapshot seq {seq} in {slot.meta_path} was overwritten while being sent; "
            "send the newer one (or lower the snapshot cadence during the transfer)"
        )
    ch.send({"type": "commit", "seq": seq})
    return _reply(ch.recv("result"))


def _reply(obj: dict[str, Any]) -> dict[str, Any]:
    if obj.get("type") == "ready" or obj.get("ok") is True:
        return obj
    code, message = str(obj.get("code", "error")), str(obj.get("message", "no message"))[:500]
    if code == "checksum_mismatch":
        bad = obj.get("chunks")
        chunks = [int(c) for c in bad] if isinstance(bad, list) else []
        raise ChunkMismatchError(f"receiver: {message}", chunks)
    raise TransferProtocolError(f"receiver refused the transfer: {message} [{code}]")


def _send_range(
    sock: socket.socket, src: _Source, offset: int, length: int, pacer: Pacer | None
) -> None:
    """``sendall`` straight from the slot's mapping (no copy in Python). Measured here
    faster than ``sendfile`` from tmpfs over loopback (bench/transfer.py reports both)."""
    piece = length if pacer is None else pacer.piece
    with src.view(offset, length) as chunk:
        done = 0
        while done < length:
            n = min(piece, length - done)
            if pacer is not None:
                pacer.take(n)
            with chunk[done : done + n] as part:
                sock.sendall(part)
            done += n
