"""Receive snapshot slots into local shared-memory slot directories.

A :class:`SlotReceiver` listens (127.0.0.1 by default), authenticates each sender with
the job token, and writes the offered snapshot straight into a slot of
``<shm_dir>/stalwart-<namespace>/`` with ``recv_into`` on the slot's mapping. Why it is
safe to read there at any time: the target slot is never the newest complete one
(double buffering, as the Snapshotter does), its meta is removed before the first byte
and written (by rename) only after every chunk matched its xxh3-128. So the directory
always holds the previous complete copy or the new one, never a torn one, and
``Snapshotter.restore`` / the persister read the received slot like a local snapshot.

Checksums are computed on a helper thread while the next chunk arrives (xxhash releases
the GIL), so verification adds only the last chunk's hash to the transfer time.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from types import TracebackType
from typing import Any

from stalwart.checkpoint.slots import SlotMeta, Window, ensure_private_dir, pinned_slots
from stalwart.contract.shm_names import slot_dir
from stalwart.coordinator.admission import LISTEN_BACKLOG, Admission, accept_loop
from stalwart.errors import ConfigError
from stalwart.logs import get_logger
from stalwart.transfer import _wire
from stalwart.transfer._receiver_config import ReceiverConfig, ReceiveResult
from stalwart.transfer._targets import Target, hash_window, layout_fits, mismatch
from stalwart.transfer.errors import ChunkMismatchError, TransferError, TransferProtocolError

__all__ = ["ReceiveResult", "ReceiverConfig", "SlotReceiver"]

_log = get_logger(__name__)
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_QUIET_S = 10.0  # failed handshakes are logged at most once per this many seconds


class SlotReceiver:
    """TCP server that stores authenticated snapshot transfers as complete slots."""

    def __init__(
        self,
        token: bytes,
        config: ReceiverConfig | None = None,
        on_result: Callable[[ReceiveResult], None] | None = None,
    ) -> None:
        self.config = config or ReceiverConfig()
        self._token = token
        self._on_result = on_result
        self._targets: dict[str, Target] = {}
        self._released: set[str] = set()
        self._results: deque[ReceiveResult] = deque(maxlen=1000)
        self._cond = threading.Condition()
        cfg = self.config
        self._admission = Admission(
            cfg.max_connections, cfg.max_unauthenticated, cfg.max_unauthenticated_per_peer
        )
        self._writing: dict[str, socket.socket] = {}  # namespace -> its transfer's socket
        self._closing = False
        self._failed_handshakes = 0
        self._quiet_until = 0.0
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> tuple[str, int]:
        sock = socket.create_server((self.config.host, self.config.port), backlog=LISTEN_BACKLOG)
        self._listener = sock
        self._acceptor = threading.Thread(
            target=accept_loop,
            args=(sock, self._admission, self._serve, self._is_closing, "replica receiver", _log),
            name="stalwart-xfer-accept",
            daemon=True,
        )
        self._acceptor.start()
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise TransferError("receiver not started; call start() first")
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Stop listening, cut transfers in flight (they publish nothing), join threads."""
        with self._cond:
            self._closing = True
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
        if self._acceptor is not None:
            self._acceptor.join()
        if self._listener is not None:
            self._listener.close()
        self._admission.close_all(self.config.io_timeout_s)
        for target in self._targets.values():
            for s in target.slots:
                s.close()

    def __enter__(self) -> SlotReceiver:
        self.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------ results
    def results(self) -> list[ReceiveResult]:
        with self._cond:
            return list(self._results)

    def wait_results(self, count: int, timeout_s: float) -> list[ReceiveResult]:
        """Block until ``count`` transfers ended (or raise TimeoutError at the deadline)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._results) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._results)} of {count} transfers ended")
                self._cond.wait(left)
            return list(self._results)

    def _record(self, result: ReceiveResult, handshake: bool = False) -> None:
        quiet, count = False, 0
        with self._cond:
            self._results.append(result)
            self._cond.notify_all()
            if handshake:  # anyone can fail a handshake: a flood must not flood the log
                self._failed_handshakes += 1
                now = time.monotonic()
                quiet = now < self._quiet_until
                if not quiet:
                    self._quiet_until = now + _QUIET_S
                    count, self._failed_handshakes = self._failed_handshakes, 0
        if handshake and not quiet:
            _log.warning(
                "%d connection(s) failed the handshake (latest from %s: %s); more in the "
                "next %gs are not logged",
                count,
                result.peer,
                result.error,
                _QUIET_S,
            )
        elif not result.ok and not handshake:
            _log.warning("transfer from %s rejected: %s", result.peer, result.error)
        if self._on_result is not None:
            self._on_result(result)

    # ------------------------------------------------------------ serving
    def _is_closing(self) -> bool:
        return self._closing

    @property
    def stats(self) -> dict[str, int]:
        """Connection counters (coordinator/admission.py): accepted, evicted, refused,
        authenticated."""
        return self._admission.stats

    def _serve(self, conn: socket.socket, address: Any) -> None:
        cfg = self.config
        peer = f"{address[0]}:{address[1]}"
        t0 = time.perf_counter()
        ch: _wire.Channel | None = None
        state: dict[str, Any] = {}
        try:
            if self._admission.authenticated_full():
                _wire.refuse(conn, "too_many_connections", "receiver connection limit reached")
                return
            conn.settimeout(cfg.handshake_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + cfg.handshake_timeout_s
            ch = _wire.server_handshake(conn, self._token, deadline, cfg.io_timeout_s)
            if not self._admission.promote(conn):
                raise TransferProtocolError("receiver connection limit reached; retry later")
            conn.settimeout(cfg.io_timeout_s)
            result = self._receive(ch, peer, state)
            self._record(replace(result, seconds=time.perf_counter() - t0))
        except (TransferError, OSError) as err:
            message = _describe(err)
            bad = tuple(err.chunks) if isinstance(err, ChunkMismatchError) else ()
            if ch is not None and not isinstance(err, OSError):
                code = "checksum_mismatch" if bad else "rejected"
                with contextlib.suppress(OSError):
                    ch.send(
                        {
                            "type": "result",
                            "ok": False,
                            "code": code,
                            "message": message,
                            "chunks": list(bad),
                        }
                    )
            self._record(
                ReceiveResult(
                    False,
                    peer,
                    state.get("namespace"),
                    error=message,
                    bad_chunks=bad,
                    seconds=time.perf_counter() - t0,
                ),
                handshake=ch is None,
            )
        except Exception as err:  # a bug must not kill the server thread silently
            _log.exception("transfer from %s failed", peer)
            self._record(
                ReceiveResult(
                    False, peer, state.get("namespace"), error=f"internal error: {err!r}"[:300]
                )
            )

    def _receive(self, ch: _wire.Channel, peer: str, state: dict[str, Any]) -> ReceiveResult:
        cfg = self.config
        offer = ch.recv("offer")
        ns = _wire.field(offer, "namespace", str)
        if not _NAMESPACE.match(ns):
            raise TransferProtocolError(f"namespace {ns[:80]!r}: use letters, digits, . _ -")
        state["namespace"] = ns
        size = _wire.field(offer, "data_size", int)
        chunk = _wire.field(offer, "chunk_bytes", int)
        count = _wire.field(offer, "chunks", int)
        meta_len = _wire.field(offer, "meta_bytes", int)
        if not 0 <= size <= cfg.max_bytes:
            raise TransferProtocolError(
                f"offer of {size} bytes; this receiver takes <= {cfg.max_bytes}"
            )
        if chunk < 1 or count != -(-size // chunk) or not 0 < meta_len <= cfg.max_meta_bytes:
            raise TransferProtocolError(
                f"inconsistent offer: {size} bytes, {count} chunks of {chunk}"
            )
        meta_bytes = ch.recv_raw(meta_len)
        _wire.decode(meta_bytes)  # a JSON object of finite numbers, else a protocol error
        meta = SlotMeta.decode(meta_bytes)
        if meta is None or meta.data_size != size or not layout_fits(meta, size):
            raise TransferProtocolError("the offered slot meta is not a valid stalwart slot meta")
        target = self._target(ns)
        with target.lock, self._transfer_into(ns, ch.sock):
            slot = target.choose()
            slot.invalidate()  # from here until publish, this slot is not a snapshot
            slot.allocate(size)
            ch.send({"type": "ready", "slot": slot.index})
            bad = self._chunks(ch, slot.data_path, size, chunk, count)
            end = ch.recv(("commit", "abort"))
            if end["type"] == "abort":
                raise TransferError(f"sender aborted: {str(end.get('reason'))[:200]}")
            if end.get("seq") != meta.seq:
                raise TransferProtocolError(
                    f"commit of seq {end.get('seq')!r}, offer was {meta.seq}"
                )
            if bad:
                raise ChunkMismatchError(mismatch(bad, chunk, size), bad)
            slot.publish(meta)
        ch.send({"type": "result", "ok": True, "namespace": ns, "slot": slot.index})
        return ReceiveResult(True, peer, ns, slot.index, meta.step, meta.seq, size)

    def _chunks(self, ch: _wire.Channel, path: str, size: int, chunk: int, count: int) -> list[int]:
        """Receive every chunk into the file at ``path``; return the indices whose xxh3
        differs. Each chunk is written through its own mapping, unmapped once hashed: a
        process's exit tears its mappings down before it closes its sockets, so an agent
        that died holding a whole slot mapped was seen by its buddy 20-60 ms later (a
        replica transfer runs about half the time)."""
        claims: list[str] = []
        fd = os.open(path, os.O_RDWR)
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="stalwart-xfer-verify") as pool:
                futures: list[Future[str]] = []
                for i in range(count):
                    head = ch.recv("chunk")
                    offset = _wire.field(head, "offset", int)
                    length = _wire.field(head, "length", int)
                    digest = _wire.field(head, "xxh3", str)
                    if (_wire.field(head, "i", int), offset, length) != (
                        i,
                        i * chunk,
                        min(chunk, size - i * chunk),
                    ) or not _HEX32.match(digest):
                        raise TransferProtocolError(f"chunk header {i} does not follow the offer")
                    window = Window(fd, offset, length)
                    try:
                        _wire.recv_into_exact(ch.sock, window.view)
                    except BaseException:
                        window.close()
                        raise
                    claims.append(digest)
                    futures.append(pool.submit(hash_window, window))
        finally:
            os.close(fd)  # each window holds its own reference to the file
        return [i for i, (f, c) in enumerate(zip(futures, claims, strict=True)) if f.result() != c]

    def namespaces(self) -> list[str]:
        """Namespaces received into so far (and not released)."""
        with self._cond:
            return list(self._targets)

    def release(self, namespace: str) -> str:
        """Hand the received copy of ``namespace`` over to its new owner: wait for a
        transfer into it to end, refuse further transfers into it,
        and return its directory (the caller may move or delete it)."""
        with self._cond:
            self._released.add(namespace)
            target = self._targets.pop(namespace, None)
            writer = self._writing.get(namespace)
        if writer is not None:  # its sender may hang (a lost node): cut it, never wait on it
            with contextlib.suppress(OSError):
                writer.shutdown(socket.SHUT_RDWR)
        if target is not None:
            if not target.lock.acquire(timeout=self.config.release_timeout_s):
                raise TransferError(
                    f"a transfer into {namespace!r} did not stop within "
                    f"{self.config.release_timeout_s:g}s of being cut; its copy cannot be "
                    "handed over (retry the takeover, or restore from disk)"
                )
            target.lock.release()  # a transfer into it has ended (and left nothing mapped)
        return slot_dir(self.config.shm_dir, namespace)

    @contextlib.contextmanager
    def _transfer_into(self, namespace: str, sock: socket.socket) -> Iterator[None]:
        with self._cond:
            if namespace in self._released:
                raise TransferProtocolError(f"namespace {namespace!r} was released here")
            self._writing[namespace] = sock
        try:
            yield
        finally:
            with self._cond:
                self._writing.pop(namespace, None)

    def prepare(self, namespace: str, nbytes: int) -> None:
        """Allocate the pages of every free slot of ``namespace`` for ``nbytes`` now, so
        that the next transfer of that size does not pay for it (a first transfer into a
        slot runs at about half speed here). A joiner calls this after the prefetch,
        while the survivors still train, so the transfer at the step boundary is warm."""
        if not 0 <= nbytes <= self.config.max_bytes:
            raise TransferError(f"prepare {nbytes} bytes: over this receiver's max_bytes")
        target = self._target(namespace)
        with target.lock:
            pinned = pinned_slots(target.directory)
            for slot in target.slots:
                try:
                    on_disk = os.path.getsize(slot.data_path)
                except FileNotFoundError:
                    on_disk = 0
                # never shrink a file (a complete slot of a larger state stays intact)
                if slot.index not in pinned and on_disk <= nbytes:
                    slot.allocate(nbytes)

    def _target(self, namespace: str) -> Target:
        with self._cond:
            if namespace in self._released:
                raise TransferProtocolError(f"namespace {namespace!r} was released here")
            target = self._targets.get(namespace)
            if target is None:
                directory = slot_dir(self.config.shm_dir, namespace)
                os.makedirs(self.config.shm_dir, exist_ok=True)
                try:  # 0700 and ours, or refused (a name squatted by another user)
                    ensure_private_dir(directory)
                except ConfigError as err:
                    raise TransferError(str(err)) from err
                target = self._targets[namespace] = Target(directory, self.config.slots)
            return target


def _describe(err: BaseException) -> str:
    if isinstance(err, TimeoutError | socket.timeout):
        return "the sender stalled past io_timeout_s; connection dropped"
    if isinstance(err, OSError) and not isinstance(err, TransferError):
        return f"connection lost: {err.strerror or err}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__
