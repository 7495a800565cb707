"""POSIX storage primitives for local disks and shared filesystems (NFS, Lustre, FUSE).

Everything the protocol needs to be durable and race-free lives here: exclusive
create, fsync of files *and* directories, rename that never replaces, atomic
replace of small files, and retries of ``ESTALE`` (a stale NFS handle is often
transient right after another node renamed a directory).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TypeVar

from ckptguard.errors import CheckpointError

T = TypeVar("T")

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)

# Errors that mean "this filesystem does not support that", where we fall back.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}


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
                raise CheckpointError(
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


def write_all(fd: int, data: memoryview) -> None:
    """os.write until every byte is written (writes may be partial on network filesystems)."""
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    while view:
        n = os.write(fd, view)
        view = view[n:]


def unique_tmp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{uuid.uuid4().hex[:12]}")


def write_new_file(path: str, data: bytes | bytearray | memoryview) -> None:
    """Create ``path`` (O_EXCL: never over someone else's file), write ``data``, fsync. A file
    this call created is removed again if writing it fails (a full disk keeps no half file)."""
    fd = retry_stale(lambda: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644),
                     "create", path)
    try:
        write_all(fd, memoryview(data))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
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
        _unlink_quietly(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")


class PosixStorage:
    """Primitives on one POSIX directory tree (a checkpoint root as this node sees it)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.fspath(root))

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    # -- directories --------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        retry_stale(lambda: makedirs_durable(path), "create a directory", path)

    def mkdir_durable(self, path: str) -> None:
        """Create ``path`` (which must not exist) and make its entry durable in the parent."""
        retry_stale(lambda: os.mkdir(path), "create a directory", path)
        fsync_dir(os.path.dirname(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return retry_stale(lambda: os.listdir(path), "list a directory", path)
        except FileNotFoundError:
            return []

    def remove_tree(self, path: str) -> None:
        def rm() -> None:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, onerror=_ignore_missing)
            elif os.path.lexists(path):
                os.unlink(path)

        retry_stale(rm, "remove", path)

    def rename_noreplace(self, src: str, dst: str) -> None:
        retry_stale(lambda: rename_noreplace(src, dst), "rename", src)
        fsync_dir(os.path.dirname(dst))
        if os.path.dirname(src) != os.path.dirname(dst):
            fsync_dir(os.path.dirname(src))

    # -- files --------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return retry_stale(lambda: os.path.lexists(path), "look up", path)

    def size(self, path: str) -> int | None:
        try:
            return retry_stale(lambda: os.stat(path).st_size, "stat", path)
        except FileNotFoundError:
            return None

    def read_bytes(self, path: str) -> bytes:
        def read() -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return retry_stale(read, "read", path)

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data``: temp file, fsync, rename, fsync of the directory."""
        replace_file(path, data)

    def create_exclusive(self, path: str, content: bytes) -> bool:
        """Create ``path`` holding ``content`` only if it does not exist; True if we created it.

        The file appears complete or not at all: we write a private temp file and
        hard-link it into place (link(2) fails with EEXIST atomically, also over NFS
        and sshfs). Where hard links are unsupported we fall back to O_EXCL.
        """
        tmp = unique_tmp_name(path)
        write_new_file(tmp, content)
        try:
            os.link(tmp, path)
            created = True
        except FileExistsError:
            created = False
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            created = self._create_excl_fallback(path, content)
        finally:
            _unlink_quietly(tmp)
        if created:
            fsync_dir(os.path.dirname(path))
        return created

    @staticmethod
    def _create_excl_fallback(path: str, content: bytes) -> bool:
        try:
            write_new_file(path, content)
        except FileExistsError:
            return False
        return True

    @contextmanager
    def open_exclusive(self, path: str) -> Iterator[int]:
        """A raw fd on a new file (O_EXCL: two writers on one path is an error, never a mix)."""
        fd = retry_stale(
            lambda: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644),
            "create",
            path,
        )
        try:
            yield fd
        finally:
            os.close(fd)

    def wait_visible(self, path: str, size: int | None = None, timeout: float = 30.0) -> None:
        """Wait until ``path`` is visible here (and has ``size`` bytes, if given).

        Another node's create or rename can take seconds to show through an NFS
        client's attribute and lookup caches; we poll with back-off instead of
        trusting the first answer.
        """
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            seen = self.size(path) if size is not None else (0 if self.exists(path) else None)
            if seen is not None and (size is None or seen == size):
                return
            if time.monotonic() >= deadline:
                state = "missing" if seen is None else f"{seen} bytes, expected {size}"
                raise CheckpointError(
                    f"{path} is not visible with the right size after {timeout:.0f} s ({state}). "
                    "Either a writer failed, or this node's view of the shared filesystem is stale "
                    "for longer than the timeout.",
                    path=path,
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def free_bytes(self, path: str) -> int | None:
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize


def _ignore_missing(func: Callable[..., object], path: str, exc_info: tuple[type, BaseException, object]) -> None:
    # Another node may be removing the same tree (NFS silly-renames, concurrent clean-up).
    if isinstance(exc_info[1], FileNotFoundError):
        return
    raise exc_info[1]


def _unlink_quietly(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def explain_os_error(err: OSError, path: str, rank: int | None, needed_bytes: int | None = None,
                     root: str | None = None) -> CheckpointError:
    """Turn the OS errors users hit most into messages that say what to do."""
    who = f"rank {rank}" if rank is not None else "this process"
    where = getattr(err, "filename", None) or path
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        target = root or path
        free = None
        try:
            st = os.statvfs(target)
            free = st.f_bavail * st.f_frsize
        except OSError:
            pass
        need = f"{who} needed {needed_bytes:,} bytes for its part" if needed_bytes is not None else f"{who} ran out"
        have = f", {free:,} bytes are free" if free is not None else ""
        kind = "quota exceeded" if err.errno == errno.EDQUOT else "disk full"
        return CheckpointError(
            f"{kind} on {target} while writing {where}: {need}{have}. Free space (or lower keep_last) "
            "and save again; nothing of this save was committed.", rank=rank, path=where)
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "the filesystem is read-only" if err.errno == errno.EROFS else "permission denied"
        return CheckpointError(
            f"{why}: {who} (uid {os.getuid()}) cannot write {where}. Make the checkpoint root writable "
            "by the user the training job runs as, on every node.", rank=rank, path=where)
    return CheckpointError(f"{who} failed on {where}: {type(err).__name__}: {err}", rank=rank, path=where)


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
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
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
