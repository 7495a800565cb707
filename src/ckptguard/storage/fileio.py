"""Durable file operations on POSIX filesystems (local disks, NFS, Lustre, FUSE): fsync of files *and*
directories, rename that never replaces, atomic replace, exclusive create, reads of regular files only,
retries of ESTALE. PosixStorage (posix.py) and the few places that write user-side files use them."""

from __future__ import annotations

import ctypes
import errno
import io
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, TypeVar

from ckptguard._signals import signals_deferred
from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StaleHandleError,
)

T = TypeVar("T")

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)

# Errors that mean "this filesystem does not support that", where we fall back.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}
#: Lock files that guard compare-and-swap, under the root's control directory.
LOCKS_DIR = ".ckptguard/locks"
#: How long a compare-and-swap waits for a lock whose holder may be frozen before breaking it.
CAS_LOCK_TIMEOUT_S = 10.0
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def retry_stale(fn: Callable[[], T], what: str, path: str, attempts: int = 8) -> T:
    """Run ``fn``, retrying ``ESTALE`` with exponential back-off (about 6 s in all)."""
    delay = 0.05
    for attempt in range(attempts):
        try:
            return fn()
        except OSError as e:
            if e.errno != errno.ESTALE:
                raise
            if attempt == attempts - 1:
                raise StaleHandleError(
                    f"stale file handle (ESTALE) on {path} while trying to {what}, still failing "
                    f"after {attempts} retries over {delay * 2:.1f} s: another node renamed or removed "
                    "it and this node's NFS client still holds the old handle. Check that only one job "
                    "writes to this checkpoint root, and the NFS mount options (lookupcache, actimeo).",
                    path=path,
                ) from e
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def _open_fd(path: str, flags: int) -> int:
    """``os.open`` with ESTALE retried, never lost to a Ctrl-C: a KeyboardInterrupt raised as the call
    returns (Python runs signal handlers right after a builtin call) would drop the only reference to
    the descriptor, leaking one per interrupted save or load. The signal is delivered once the
    descriptor is this function's to close."""
    fd = -1
    try:
        with signals_deferred():
            fd = retry_stale(lambda: os.open(path, flags), "open", path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def _regular_and_blocking(fd: int, path: str) -> None:
    """Refuse anything but a regular file (opened O_NONBLOCK so that a FIFO never blocks the open),
    then read it blocking."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise CorruptCheckpointError(f"{path} is not a regular file: refusing to read it", path=path)
    os.set_blocking(fd, True)


def open_owned(path: str, flags: int, mode: int = 0o644, what: str = "open", *, regular: bool = False) -> io.FileIO:
    """A descriptor owned by a FileIO from the instant it exists (opened under ``signals_deferred``):
    dropped for whatever reason, a second Ctrl-C interrupting the cleanup code included, it is closed by
    the object's C deallocator, which no Python signal handler can interrupt. ``regular``: anything but
    a regular file is refused as a corrupt checkpoint's, and the file is read blocking."""
    with signals_deferred():
        fd = retry_stale(lambda: os.open(path, flags, mode), what, path)
        try:
            if regular:
                _regular_and_blocking(fd, path)
            owner = io.FileIO(fd, "r", closefd=True)
        except BaseException:
            os.close(fd)
            raise
    return owner


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creates, renames, unlinks) durable. Its descriptor is opened and
    closed with a Ctrl-C held back (a FileIO cannot own a directory's): none is left open."""
    with signals_deferred():
        try:
            fd = retry_stale(lambda: os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), "open", path)
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                return
            raise
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
        finally:
            os.close(fd)


def rmtree_off_main_thread(path: str, **kwargs: Any) -> None:
    """``shutil.rmtree`` in a thread of its own when called from the main thread: the directory
    descriptors it opens and closes (stdlib code, with statements between the two) are then never in
    a frame that a Ctrl-C unwinds, since signal handlers run in the main thread only. A Ctrl-C while
    waiting is raised at once; the removal (of garbage) finishes on its own."""
    if threading.current_thread() is not threading.main_thread():
        shutil.rmtree(path, **kwargs)
        return
    errors: list[BaseException] = []

    def remove() -> None:
        try:
            shutil.rmtree(path, **kwargs)
        except BaseException as e:
            errors.append(e)

    remover = threading.Thread(target=remove, name="ckptguard-rmtree", daemon=True)
    with signals_deferred():
        remover.start()
    remover.join()
    if errors:
        raise errors[0]


def makedirs_durable(path: str, within: str | None = None) -> None:
    """os.makedirs(path, exist_ok=True), then fsync the parent of every directory it created:
    fsync of a directory's contents does not make its own entry in its parent durable.

    ``within``: a directory above ``path`` that must exist: nothing at or above it is created
    (FileNotFoundError if it is gone), so that a directory moved away (a save's attempt, by a job
    that took the root over) is never made again under its old name."""
    missing = []
    p = path
    stop = os.path.normpath(within) if within is not None else None
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        if stop is not None and os.path.normpath(p) == stop:
            raise FileNotFoundError(errno.ENOENT, "the directory to create a directory in is gone", within)
        missing.append(p)
        p = os.path.dirname(p)
    if stop is None:
        os.makedirs(path, exist_ok=True)
    else:
        for d in reversed(missing):  # one level at a time: a parent moved away meanwhile fails the mkdir
            with suppress(FileExistsError):
                os.mkdir(d)
    for d in reversed(missing):
        fsync_dir(os.path.dirname(d))


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``; fail with FileExistsError if ``dst`` exists.

    Uses renameat2(RENAME_NOREPLACE) where the kernel and filesystem support it.
    Elsewhere it falls back to a plain rename, which for our directories is still
    safe: rename(2) refuses to replace a non-empty directory, and a committed
    checkpoint directory is never empty.
    """
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            if err in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(err, os.strerror(err), dst)
            raise OSError(err, os.strerror(err), src)
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(e.errno, os.strerror(e.errno), dst) from e
        raise


def write_all(fd: int, views: Sequence[memoryview]) -> None:
    """writev until every byte is written (writes may be partial on network filesystems)."""
    pending = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if len(v)]
    while pending:
        pending = after(pending, os.writev(fd, pending[:1024]))


def after(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of ``views`` once a vectored read or write moved ``n`` bytes (it may stop anywhere)."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def unique_tmp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{uuid.uuid4().hex[:12]}")


def is_tmp_name_of(entry: str, tail: str | None = None) -> bool:
    """Whether directory entry ``entry`` is a name :func:`unique_tmp_name` gave (for a file named
    ``tail``, or any file when ``tail`` is None)."""
    if not entry.startswith(".") or len(entry) < 18 or entry[-17:-12] != ".tmp-":
        return False
    return (tail is None or entry[1:-17] == tail) and all(c in "0123456789abcdef" for c in entry[-12:])


def buffer_views(data: bytes | bytearray | memoryview | Sequence[bytes]) -> list[memoryview]:
    """Views of ``data``: one buffer, or buffers to write one after another."""
    if isinstance(data, bytes | bytearray | memoryview):
        return [memoryview(data)]
    return [memoryview(part) for part in data]


def write_new_file(path: str, data: bytes | bytearray | memoryview | Sequence[bytes]) -> None:
    """Create ``path`` (O_EXCL: never over someone else's file), write ``data`` (one buffer, or
    buffers one after another), fsync. A file this call created is removed again if writing it
    fails (a full disk keeps no half file)."""
    owner = open_owned(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, "create")
    try:
        write_all(owner.fileno(), buffer_views(data))
        os.fsync(owner.fileno())
    except BaseException:
        owner.close()
        unlink_quietly(path)
        raise
    owner.close()


def replace_file(path: str, data: bytes | bytearray | memoryview | Sequence[bytes], tmp: str | None = None) -> None:
    """Replace ``path`` with ``data`` (one buffer, or buffers one after another) atomically: temp file
    (``tmp``, or a unique name beside it), fsync, rename, fsync of the directory. Readers see the old
    or the new content; a failure leaves the old file and no temp file."""
    tmp = tmp or unique_tmp_name(path)
    write_new_file(tmp, data)
    try:
        retry_stale(lambda: os.replace(tmp, path), "replace", path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")


def open_regular(path: str) -> int:
    """An fd on a regular file: symlinks and FIFOs, devices or directories are refused (a hostile
    checkpoint must not make a reader block on a FIFO or follow a link out of the checkpoint)."""
    fd = _open_fd(path, _READ_FLAGS)
    try:
        _regular_and_blocking(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_quietly(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


class PosixWriteStream:
    """A new file written with writev, made durable with fsync."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open_owned(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, "create")
        self.fd = self._file.fileno()

    def write(self, views: Sequence[memoryview], stable: bool = False) -> None:
        write_all(self.fd, views)  # written before it returns: nothing is kept either way

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        self.fd = -1
        self._file.close()


class PosixReadHandle:
    """A regular file read by ranges with preadv straight into the caller's buffers."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._file = open_owned(path, _READ_FLAGS, regular=True)
            self.fd = self._file.fileno()
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete", path=path) from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise CorruptCheckpointError(
                f"{path} is a symbolic link: refusing to follow it out of the checkpoint", path=path
            ) from None

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_into(self, views: Sequence[memoryview], offset: int) -> None:
        pending = [v for v in views if len(v)]
        total = sum(len(v) for v in pending)
        done = 0
        while pending:
            n = os.preadv(self.fd, pending[:1024], offset + done)
            if n == 0:
                raise CorruptCheckpointError(
                    f"{self.path} is truncated: {total} bytes expected at offset {offset}, the file ends at "
                    f"{self.size()}. The checkpoint is corrupt.",
                    path=self.path,
                )
            done += n
            pending = after(pending, n)

    def close(self) -> None:
        self.fd = -1
        self._file.close()


_READ_AHEAD_CHUNK = 8 << 20
_PROBE_BYTES = 4096
#: preadv2(RWF_NOWAIT): a read that fails rather than wait for the disk (Linux 4.14+; not every filesystem).
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


def _cached(fd: int, start: int, end: int, probe: bytearray) -> bool:
    """Whether the first and the last page of ``start..end`` are in the page cache already (then the
    read-ahead skips the range: a warm load's read-ahead copied its whole part for nothing, CPU the
    planning it overlaps needed). A hint, as the read-ahead is: a miss in between is read by the load."""
    if _NOWAIT is None:
        return False
    try:
        return all(
            os.preadv(fd, [probe], at, _NOWAIT) == min(len(probe), end - at)
            for at in (start, max(start, end - len(probe)))
        )
    except OSError:  # BlockingIOError: not cached; EOPNOTSUPP and the like: no way to tell
        return False


def read_ahead(directory: str, prefix: str) -> Callable[[], None]:
    """Have the kernel read the files of ``directory`` whose names start with ``prefix`` into the
    page cache, from a background thread, while the caller does other work (a hint: errors are
    left to the real reads). Returns a function that stops it.

    Plain reads into one small scratch buffer: measured here, they overlap a cold load's planning
    with the disk, where ``posix_fadvise(WILLNEED)`` gained nothing and a populated mapping
    held the GIL for the whole read.
    """

    stopped = threading.Event()

    def read_into_page_cache() -> None:
        try:
            with os.scandir(directory) as entries:
                paths = sorted(e.path for e in entries if e.name.startswith(prefix))
        except OSError:
            return
        scratch = bytearray(_READ_AHEAD_CHUNK)
        probe = bytearray(_PROBE_BYTES)
        for p in paths:
            if stopped.is_set():
                return
            try:
                fd = open_regular(p)
            except (OSError, CheckpointError):
                continue
            try:
                size = os.fstat(fd).st_size
                for at in range(0, size, len(scratch)):
                    if stopped.is_set():
                        return
                    if not _cached(fd, at, min(at + len(scratch), size), probe):
                        os.preadv(fd, [scratch], at)
            except OSError:
                pass
            finally:
                os.close(fd)

    threading.Thread(target=read_into_page_cache, name="ckptguard-readahead", daemon=True).start()
    return stopped.set
