"""POSIX storage for local disks and shared filesystems (NFS, Lustre, FUSE).

Everything the protocol needs to be durable and race-free lives here: exclusive
create, fsync of files *and* directories, rename that never replaces, atomic
replace and compare-and-swap of small files, and retries of ``ESTALE`` (a stale
NFS handle is often transient right after another node renamed a directory).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TypeVar

from ckptguard.checksum import checksum
from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NotVisibleError,
    StaleHandleError,
)
from ckptguard.storage.base import MAX_SMALL_OBJECT_BYTES

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


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creates, renames, unlinks) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
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


def makedirs_durable(path: str) -> None:
    """os.makedirs(path, exist_ok=True), then fsync the parent of every directory it created:
    fsync of a directory's contents does not make its own entry in its parent durable."""
    missing = []
    p = path
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, exist_ok=True)
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


def write_new_file(path: str, data: bytes | bytearray | memoryview) -> None:
    """Create ``path`` (O_EXCL: never over someone else's file), write ``data``, fsync. A file
    this call created is removed again if writing it fails (a full disk keeps no half file)."""
    fd = retry_stale(lambda: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644),
                     "create", path)
    try:
        write_all(fd, [memoryview(data)])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)


def replace_file(path: str, data: bytes | bytearray | memoryview) -> None:
    """Replace ``path`` with ``data`` atomically: temp file, fsync, rename, fsync of the directory.
    Readers see the old or the new content; a failure leaves the old file and no temp file."""
    tmp = unique_tmp_name(path)
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
    fd = retry_stale(lambda: os.open(path, _READ_FLAGS), "open", path)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(f"{path} is not a regular file: refusing to read it", path=path)
        os.set_blocking(fd, True)
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
        self.fd = retry_stale(lambda: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644),
                              "create", path)

    def write(self, views: Sequence[memoryview]) -> None:
        write_all(self.fd, views)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PosixReadHandle:
    """A regular file read by ranges with preadv straight into the caller's buffers."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = open_regular(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete", path=path) from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise CorruptCheckpointError(f"{path} is a symbolic link: refusing to follow it out of the "
                                         "checkpoint", path=path) from None

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
                    f"{self.size()}. The checkpoint is corrupt.", path=self.path)
            done += n
            pending = after(pending, n)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PosixStorage:
    """A checkpoint root on a POSIX filesystem (see :class:`~ckptguard.storage.base.StorageBackend`)."""

    has_directories = True

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.fspath(root))

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    # -- namespace ----------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        retry_stale(lambda: makedirs_durable(path), "create a directory", path)

    def make_dir_durable(self, path: str) -> None:
        retry_stale(lambda: os.mkdir(path), "create a directory", path)
        fsync_dir(os.path.dirname(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return retry_stale(lambda: os.listdir(path), "list a directory", path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path: str) -> bool:
        return retry_stale(lambda: os.path.lexists(path), "look up", path)

    def size(self, path: str) -> int | None:
        try:
            st = retry_stale(lambda: os.lstat(path), "stat", path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def mtime(self, path: str) -> float | None:
        try:
            return retry_stale(lambda: os.lstat(path), "stat", path).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None

    def remove_tree(self, path: str) -> None:
        def rm() -> None:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, onerror=_ignore_missing)
            elif os.path.lexists(path):
                os.unlink(path)

        retry_stale(rm, "remove", path)

    def sync_dir(self, path: str) -> None:
        fsync_dir(path)

    def rename_noreplace(self, src: str, dst: str) -> None:
        """Rename, never over an existing ``dst``; both directories' entries made durable."""
        retry_stale(lambda: rename_noreplace(src, dst), "rename", src)
        fsync_dir(os.path.dirname(dst))
        if os.path.dirname(src) != os.path.dirname(dst):
            fsync_dir(os.path.dirname(src))

    # -- small objects --------------------------------------------------------------
    def read_bytes(self, path: str, limit: int = MAX_SMALL_OBJECT_BYTES) -> bytes:
        def read() -> bytes:
            try:
                fd = open_regular(path)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise CorruptCheckpointError(f"{path} is a symbolic link: refusing to follow it", path=path) from None
            try:
                size = os.fstat(fd).st_size
                if size > limit:
                    raise CorruptCheckpointError(
                        f"{path} is {size:,} bytes, more than the {limit:,} a control file may have: "
                        "refusing to read it", path=path)
                chunks = []
                while True:
                    chunk = os.read(fd, max(size, 1 << 16))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    if sum(len(c) for c in chunks) > limit:
                        raise CorruptCheckpointError(f"{path} grew past {limit:,} bytes while read", path=path)
                return b"".join(chunks)
            finally:
                os.close(fd)

        return retry_stale(read, "read", path)

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        try:
            data = self.read_bytes(path)
        except FileNotFoundError:
            return None
        return data, checksum("xxh3-64", data)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """The file appears complete or not at all: we write a private temp file and hard-link
        it into place (link(2) fails with EEXIST atomically, also over NFS and sshfs). Where
        hard links are unsupported we fall back to O_EXCL."""
        tmp = unique_tmp_name(path)
        write_new_file(tmp, data)
        try:
            os.link(tmp, path)
            created = True
        except FileExistsError:
            created = False
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            created = _create_excl_fallback(path, data)
        finally:
            unlink_quietly(tmp)
        if created:
            fsync_dir(os.path.dirname(path))
        return created

    def replace(self, path: str, data: bytes) -> None:
        replace_file(path, data)

    def compare_and_swap(self, path: str, data: bytes, token: str | None) -> bool:
        """Under an exclusive lock on a lock file of its own (flock; POSIX locks over NFSv4), so that
        two writers never both see the same version and both replace it.

        The lock is held for a read and a rename. A holder frozen inside that
        window (SIGSTOP, a suspended VM) must not block everyone for ever: after
        ``CAS_LOCK_TIMEOUT_S`` the lock file is moved aside and a fresh one taken.
        The frozen holder, when it wakes, finds its lock broken and does not write
        (it would overwrite the swap of whoever broke it, a new lease holder's
        record say). The new content is written and fsynced to a temp file first
        (an fsync can hang for long: an NFS server failing over), and the lock is
        looked at after that, right before the rename: only a freeze between
        that look and the rename itself (two system calls) is left, and a swap
        that finds its lock broken after the rename reports failure.
        """
        if token is None:
            return self.create_exclusive(path, data)
        fd = self._locked(path)
        tmp: str | None = None
        try:
            current = self.read_versioned(path)
            if current is None or current[1] != token:
                return False
            tmp = staged = unique_tmp_name(path)
            write_new_file(staged, data)
            if not self._still_locked(fd, path):
                return False
            retry_stale(lambda: os.replace(staged, path), "replace", path)
            tmp = None
            fsync_dir(os.path.dirname(path) or ".")
            return self._still_locked(fd, path)
        finally:
            if tmp is not None:
                unlink_quietly(tmp)
            os.close(fd)  # releases the lock

    def _still_locked(self, fd: int, path: str) -> bool:
        """Is ``fd`` still the lock file of ``path`` (not moved aside by someone who timed out on it)?"""
        try:
            return os.fstat(fd).st_ino == os.stat(self._lock_path(path)).st_ino
        except FileNotFoundError:
            return False

    def _locked(self, path: str) -> int:
        deadline = time.monotonic() + CAS_LOCK_TIMEOUT_S
        delay = 0.001
        while True:
            lock_path = self._lock_path(path)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
                    continue
                with suppress(FileNotFoundError):  # a holder frozen inside its swap: break the lock
                    os.rename(lock_path, unique_tmp_name(lock_path) + ".broken")
                deadline = time.monotonic() + CAS_LOCK_TIMEOUT_S
                continue
            except OSError:
                return fd  # a filesystem without locks: the version check still narrows the race
            try:
                if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)  # the file was broken and replaced while we waited for it: lock the new one

    def _lock_path(self, path: str) -> str:
        """The lock file that guards compare-and-swap of ``path`` (kept out of the root's listing)."""
        rel = os.path.relpath(path, self.root)
        if rel.startswith(".."):
            return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")
        lock_dir = os.path.join(self.root, LOCKS_DIR)
        os.makedirs(lock_dir, exist_ok=True)
        return os.path.join(lock_dir, rel.replace("%", "%25").replace("/", "%2F") + ".lock")

    def delete(self, path: str) -> None:
        unlink_quietly(path)

    def delete_if_version(self, path: str, token: str) -> bool:
        """Under the lock that compare_and_swap takes: a writer that replaced the file since the
        caller read it keeps its version."""
        fd = self._locked(path)
        try:
            current = self.read_versioned(path)
            if current is None or current[1] != token or not self._still_locked(fd, path):
                return False
            unlink_quietly(path)
            fsync_dir(os.path.dirname(path))
            return True
        finally:
            os.close(fd)

    def publish(self, src: str, dst: str) -> None:
        self.rename_noreplace(src, dst)

    # -- data -----------------------------------------------------------------------
    def open_new(self, path: str) -> PosixWriteStream:
        return PosixWriteStream(path)

    def open_read(self, path: str) -> PosixReadHandle:
        return PosixReadHandle(path)

    def wait_visible(self, path: str, size: int | None = None, timeout: float = 30.0) -> None:
        """Another node's create or rename can take seconds to show through an NFS client's
        attribute and lookup caches: poll with back-off instead of trusting the first answer."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            seen = self.size(path) if size is not None else (0 if self.exists(path) else None)
            if seen is not None and (size is None or seen == size):
                return
            if time.monotonic() >= deadline:
                state = "missing" if seen is None else f"{seen} bytes, expected {size}"
                raise NotVisibleError(
                    f"{path} is not visible with the right size after {timeout:.0f} s ({state}). "
                    "Either a writer failed, or this node's view of the shared filesystem is stale "
                    "for longer than the timeout.", path=path)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def sizes_in(self, directory: str) -> dict[str, int]:
        """Name -> size of the regular files in ``directory`` (one listing: a round trip on NFS)."""
        out: dict[str, int] = {}
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    with suppress(FileNotFoundError):
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            out[entry.name] = st.st_size
        except (FileNotFoundError, NotADirectoryError):
            pass
        return out

    def free_bytes(self, path: str) -> int | None:
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def prefetch(self, directory: str, prefix: str) -> Callable[[], None]:
        return read_ahead(directory, prefix)


def _create_excl_fallback(path: str, content: bytes) -> bool:
    try:
        write_new_file(path, content)
    except FileExistsError:
        return False
    return True


def _ignore_missing(func: Callable[..., object], path: str, exc_info: tuple[type, BaseException, object]) -> None:
    # Another node may be removing the same tree (NFS silly-renames, concurrent clean-up).
    if isinstance(exc_info[1], FileNotFoundError):
        return
    raise exc_info[1]


_READ_AHEAD_CHUNK = 8 << 20


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
        for p in paths:
            if stopped.is_set():
                return
            try:
                fd = open_regular(p)
            except (OSError, CheckpointError):
                continue
            try:
                while not stopped.is_set() and os.readv(fd, [scratch]) == len(scratch):
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)

    threading.Thread(target=read_into_page_cache, name="ckptguard-readahead", daemon=True).start()
    return stopped.set
