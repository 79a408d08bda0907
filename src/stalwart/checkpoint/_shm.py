"""Shared-memory snapshot slots: files in /dev/shm, readable without torch.

A slot is two files in ``<shm_dir>/stalwart-<namespace>/``: ``slot<i>.data`` (tensor bytes
at fixed offsets) and ``slot<i>.json`` (what those bytes are: step, sequence number,
tensor layout, the JSON tree of the state). The JSON is written by rename *after* the
copy finished and removed *before* a copy starts, so a slot with a JSON file is always
complete; a process killed mid-copy leaves that slot invisible and the other intact.

The files outlive the process that wrote them: a worker crash loses no snapshot, and the
node agent (or a persister process that imports no torch) can read them by name.

Why pre-fault: on this VM the first touch of a tmpfs page costs ~15x a later copy
(0.8 GB/s against ~12 GB/s, measured on a 2-core VM), so pages are allocated
(fallocate) and mapped with MAP_POPULATE when a slot is created or grown, never during
a snapshot.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import re
import secrets
import stat
import weakref
from dataclasses import dataclass, field
from typing import IO, Any

from stalwart.errors import ConfigError, SnapshotDirectoryGoneError, SnapshotWontFitError

__all__ = [
    "SlotDirectory",
    "SlotFiles",
    "SlotMeta",
    "Window",
    "check_fits",
    "ensure_private_dir",
    "open_private",
    "pin_slot",
    "pinned_slots",
    "slot_count",
    "unpin_slot",
]

SLOT_FORMAT = "stalwart.shm-slot"
SLOT_VERSION = 1
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def open_private(path: str, mode: str = "w") -> IO[Any]:
    """Open ``path`` for writing (``"w"`` or ``"wb"``), created 0600 and never through a
    link: a link planted at the name (``ELOOP``) is refused rather than followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600)
    return os.fdopen(fd, mode)


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700), or accept an existing one only if it is a real
    directory (not a link) owned by this user and writable by no one else: on a shared
    host another user could otherwise pre-create a job's slot directory (its name is
    derived from the job id) and read or replace the snapshots written into it."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        what = (
            "a link or not a directory"
            if not stat.S_ISDIR(st.st_mode)
            else (f"owned by uid {st.st_uid}" if st.st_uid != os.getuid() else "writable by others")
        )
        raise ConfigError(
            f"{path} exists and is {what}: refusing to put snapshots there; remove it, "
            "or run the job under another --rdzv-id / job id"
        )


@dataclass
class SlotMeta:
    """Describes a complete slot. ``layout`` entries: id, path, dtype, shape, nbytes,
    offset, and optionally ``shard`` / ``ndarray``."""

    seq: int
    step: int
    tree: Any
    layout: list[dict[str, Any]]
    data_size: int
    extra: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": SLOT_FORMAT,
                "version": SLOT_VERSION,
                "seq": self.seq,
                "step": self.step,
                "tree": self.tree,
                "layout": self.layout,
                "data_size": self.data_size,
                "extra": self.extra,
            },
            separators=(",", ":"),
            allow_nan=False,
        ).encode()

    @staticmethod
    def decode(data: bytes) -> SlotMeta | None:
        try:
            d = json.loads(data)
            if not isinstance(d, dict):  # a list, a number: not a slot's metadata
                return None
            if d.get("format") != SLOT_FORMAT or d.get("version") != SLOT_VERSION:
                return None
            return SlotMeta(
                seq=int(d["seq"]),
                step=int(d["step"]),
                tree=d["tree"],
                layout=list(d["layout"]),
                data_size=int(d["data_size"]),
                extra=dict(d.get("extra", {})),
            )
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            # OverflowError: int(inf); RecursionError: a deeply nested document
            return None


class SlotFiles:
    """The two files of one slot, and a writable mapping of the data file.

    ``dir_fd``: the slot directory opened by its writer (:class:`SlotDirectory`). Every
    file operation then goes through that directory itself, never its path: a writer
    whose directory was replaced under the same name (its node fenced, the rank adopted
    on this host and the replica renamed into place) can never write a file into the
    new one. Readers pass none and follow the path."""

    def __init__(self, directory: str, index: int, dir_fd: int | None = None) -> None:
        self.index = index
        self.data_path = os.path.join(directory, f"slot{index}.data")
        self.meta_path = os.path.join(directory, f"slot{index}.json")
        self._fd = dir_fd
        self._map: mmap.mmap | None = None
        self._size = 0

    def _at(self, path: str) -> str:
        """``path`` as this slot's file operations name it (its base name under a
        directory fd)."""
        return os.path.basename(path) if self._fd is not None else path

    def _open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(self._at(path), flags, mode, dir_fd=self._fd)

    @property
    def size(self) -> int:
        return self._size

    def allocated(self) -> int:
        """Bytes of the data file that have pages (a sparse or missing file: fewer)."""
        try:
            st = os.stat(self._at(self.data_path), dir_fd=self._fd, follow_symlinks=False)
        except OSError:
            return 0
        return int(st.st_blocks) * 512

    def read_meta(self) -> SlotMeta | None:
        try:
            fd = self._open(self.meta_path, os.O_RDONLY | _NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            if err.errno == errno.ELOOP:
                return None  # a link is never a slot of ours
            raise
        with os.fdopen(fd, "rb") as f:
            return SlotMeta.decode(f.read())

    def invalidate(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._at(self.meta_path), dir_fd=self._fd)

    def publish(self, meta: SlotMeta) -> None:
        tmp = f"{self.meta_path}.{secrets.token_hex(4)}.tmp"
        fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW)
        with os.fdopen(fd, "wb") as f:
            f.write(meta.encode())
        os.replace(
            self._at(tmp), self._at(self.meta_path), src_dir_fd=self._fd, dst_dir_fd=self._fd
        )

    def map_writable(self, size: int) -> mmap.mmap:
        """A shared writable mapping of at least ``size`` bytes, pre-faulted."""
        if self._map is not None and self._size >= size:
            return self._map
        self.close()
        size = max(size, 1)
        fd = self._open(self.data_path, os.O_RDWR | os.O_CREAT | _NOFOLLOW)
        try:
            os.ftruncate(fd, size)
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, 0, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        self._size = size
        return self._map

    def allocate(self, size: int) -> None:
        """Size the data file to ``size`` bytes with its pages allocated, and map nothing
        (a receiver writes through one chunk's :class:`Window` at a time)."""
        self.close()
        fd = self._open(self.data_path, os.O_RDWR | os.O_CREAT | _NOFOLLOW)
        try:
            os.ftruncate(fd, max(size, 1))
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, 0, max(size, 1))
        finally:
            os.close(fd)

    def map_readonly(self) -> mmap.mmap:
        fd = self._open(self.data_path, os.O_RDONLY | _NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
            self._size = 0

    def unlink(self) -> None:
        self.close()
        for p in (self.meta_path, self.data_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._at(p), dir_fd=self._fd)


class SlotDirectory:
    """A writer's own slot directory, held open: its slots' files are made through it.

    Why: on one host a node's ranks can be adopted while the node's old workers still
    run (its agent stopped or cut off, fenced, its ranks started again elsewhere): the
    adopter renames the rank's replica into the same name. Writing by path, the old
    worker's next snapshot would then unlink and publish slot metadata in the adopter's
    directory, pointing at data that is not there (a restore found ``slot1.json`` and no
    ``slot1.data``). Through the directory it opened, the old worker can only touch the
    directory that was its own, and :meth:`check_own` tells it that it is no longer
    there before it writes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
        self._st = os.fstat(self.fd)
        # closed with the last reference, never before: a slot must not keep a number
        # that a later open could reuse for another directory
        weakref.finalize(self, os.close, self.fd)

    def slots(self, count: int) -> list[SlotFiles]:
        return [SlotFiles(self.path, i, self.fd) for i in range(count)]

    def is_own(self) -> bool:
        """Whether the path still names the directory this writer opened."""
        if os.fstat(self.fd).st_nlink == 0:
            return False  # removed
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (self._st.st_dev, self._st.st_ino)

    def check_own(self) -> None:
        if not self.is_own():
            raise SnapshotDirectoryGoneError(
                f"snapshot directory {self.path} was removed or replaced while this "
                "process wrote to it: another process owns this rank's slots now (its "
                "node was fenced and the rank adopted); this process must stop"
            )


class Window:
    """A writable, pre-faulted mapping of ``[offset, offset + length)`` of an open file:
    ``view`` is exactly that range (the mapping starts at the page boundary below)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(fd, length + offset - base, flags=flags, offset=base)
        self._whole = memoryview(self._map)
        self.view = self._whole[offset - base :]

    def close(self) -> None:
        self.view.release()
        self._whole.release()
        self._map.close()


def latest_complete(
    directory: str, slots: int, step: int | None = None
) -> tuple[int, SlotMeta] | None:
    """The complete slot with the highest sequence number (among those holding ``step``,
    if given), read from files only."""
    best: tuple[int, SlotMeta] | None = None
    for i in range(slots):
        meta = SlotFiles(directory, i).read_meta()
        if meta is None or (step is not None and meta.step != step):
            continue
        if best is None or meta.seq > best[1].seq:
            best = (i, meta)
    return best


_SLOT_DATA_RE = re.compile(r"^slot(\d+)\.data$")


def slot_count(directory: str) -> int:
    """How many slots ``directory`` has (its highest ``slot<i>.data`` + 1; 0: none).

    Why read it from the files: the number of slots is the writer's choice (two, double
    buffered; three for a DDP job with replica digest checks, whose verified snapshot
    stays pinned: runtime/integrity/_checks.py), and a reader of another process's slots (a
    peer's, a taken-over replica) does not know it. Reading only the first two misses a
    step held in the third. Raises FileNotFoundError if the directory is missing."""
    found = [int(m.group(1)) for n in os.listdir(directory) if (m := _SLOT_DATA_RE.match(n))]
    return max(found) + 1 if found else 0


# -- pins held by other processes ------------------------------------------------------
# A process that reads a slot for a long time (the agent streaming it to a buddy node,
# stalwart.transfer) creates ``slot<i>.pin-<pid>-<nonce>``; the Snapshotter does not
# choose a slot pinned by a live process (a pin of a dead process is ignored), exactly as
# it skips a slot pinned in-process by a persist.

_PIN_RE = re.compile(r"^slot(\d+)\.pin-(\d+)-[0-9a-f]+$")


def pin_slot(directory: str, index: int) -> str:
    """Pin slot ``index`` of ``directory`` for this process; returns the pin's path."""
    path = os.path.join(directory, f"slot{index}.pin-{os.getpid()}-{secrets.token_hex(4)}")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600))
    return path


def unpin_slot(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pinned_slots(directory: str) -> set[int]:
    """Indices of the slots of ``directory`` pinned by a live process. Pins left by dead
    processes (a sender killed mid-transfer) are removed, so that a later process reusing
    the pid cannot make them look alive."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return set()
    pinned: set[int] = set()
    for name in names:
        m = _PIN_RE.match(name)
        if m is None:
            continue
        if _alive(int(m.group(2))):
            pinned.add(int(m.group(1)))
        else:
            unpin_slot(os.path.join(directory, name))
    return pinned


def check_fits(slot: SlotFiles, size: int, directory: str, step: int) -> None:
    """Refuse a snapshot whose slot must grow by more than /dev/shm has free.

    Why here and not at the copy: a tmpfs mapping past its free space is not an error
    when it is made (``fallocate`` fails quietly, ``MAP_POPULATE`` stops short); the copy
    then dies of SIGBUS on the first page that has none, with the slot half written.
    Checked before the slot is invalidated, the refusal leaves every complete snapshot
    as it was."""
    if slot.size >= size:
        return  # mapped at full size by this process: its pages are there
    need = size - slot.allocated()
    if need <= 0:
        return
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < need:
        mib = 1024 * 1024
        raise SnapshotWontFitError(
            f"snapshot of step {step} needs {need // mib} MiB more in "
            f"{os.path.dirname(directory)} but {free // mib} MiB are free: refused before "
            "it started (the older snapshots are intact); free space there (stale "
            "stalwart-* files) or enlarge it (mount -o remount,size=...)"
        )
