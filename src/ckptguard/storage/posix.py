"""PosixStorage: the StorageBackend of a checkpoint root on a POSIX filesystem (local disks, NFS,
Lustre, FUSE). The durable file operations it is made of are in fileio.py."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat
import time
from collections.abc import Callable, Sequence
from contextlib import suppress

from ckptguard.checksum import checksum
from ckptguard.errors import (
    CorruptCheckpointError,
    NotVisibleError,
)
from ckptguard.storage.base import MAX_SMALL_OBJECT_BYTES
from ckptguard.storage.fileio import (
    _UNSUPPORTED,
    CAS_LOCK_TIMEOUT_S,
    LOCKS_DIR,
    PosixReadHandle,
    PosixWriteStream,
    fsync_dir,
    makedirs_durable,
    open_owned,
    open_regular,
    read_ahead,
    rename_noreplace,
    replace_file,
    retry_stale,
    rmtree_off_main_thread,
    unique_tmp_name,
    unlink_quietly,
    write_new_file,
)


class PosixStorage:
    """A checkpoint root on a POSIX filesystem (see :class:`~ckptguard.storage.base.StorageBackend`)."""

    keeps_open_files = True
    cheap_small_reads = True
    cheap_listing = True
    leaves_uploads = False
    visible_once_written = False  # NFS: another node's attribute cache may not show it yet

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.fspath(root))

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def parent(self, path: str) -> str:
        return os.path.dirname(os.path.normpath(path))

    def is_dir(self, path: str, follow_links: bool = True) -> bool:
        try:
            st = os.stat(path) if follow_links else os.lstat(path)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode)

    # -- namespace ----------------------------------------------------------------
    def makedirs(self, path: str, within: str | None = None) -> None:
        retry_stale(lambda: makedirs_durable(path, within), "create a directory", path)

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
                rmtree_off_main_thread(path, onerror=_ignore_missing)
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
                        "refusing to read it",
                        path=path,
                    )
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
        return self._create_exclusive(path, data, None)

    def _create_exclusive(self, path: str, data: bytes, fence: Callable[[], None] | None) -> bool:
        """:meth:`create_exclusive`, with ``fence`` run between the temp file's fsync and the link."""
        tmp = unique_tmp_name(path)
        write_new_file(tmp, data)
        try:
            if fence is not None:
                fence()
            os.link(tmp, path)
            created = True
        except FileExistsError:
            created = False
        except FileNotFoundError:
            _fenced_or_raise(fence)
            raise
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            created = _create_excl_fallback(path, data)
        finally:
            unlink_quietly(tmp)
        if created:
            fsync_dir(os.path.dirname(path))
        return created

    def replace(self, path: str, data: bytes | Sequence[bytes]) -> None:
        replace_file(path, data)

    def compare_and_swap(
        self, path: str, data: bytes, token: str | None, fence: Callable[[], None] | None = None
    ) -> bool:
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
        that finds its lock broken after the rename reports failure. ``fence``
        runs there too, after the fsync: a job taken over while it staged (or
        waited for the lock) raises from it and changes nothing.
        """
        if token is None:
            return self._create_exclusive(path, data, fence)
        lock = self._locked(path)
        tmp: str | None = None
        try:
            current = self.read_versioned(path)
            if current is None or current[1] != token:
                return False
            tmp = staged = unique_tmp_name(path)
            write_new_file(staged, data)
            if not self._still_locked(lock.fileno(), path):
                return False
            if fence is not None:
                fence()
            try:
                retry_stale(lambda: os.replace(staged, path), "replace", path)
            except FileNotFoundError:
                _fenced_or_raise(fence)
                raise
            tmp = None
            fsync_dir(os.path.dirname(path) or ".")
            return self._still_locked(lock.fileno(), path)
        finally:
            if tmp is not None:
                unlink_quietly(tmp)
            lock.close()  # releases the lock

    def _still_locked(self, fd: int, path: str) -> bool:
        """Is ``fd`` still the lock file of ``path`` (not moved aside by someone who timed out on it)?"""
        try:
            return os.fstat(fd).st_ino == os.stat(self._lock_path(path)).st_ino
        except FileNotFoundError:
            return False

    def _locked(self, path: str) -> io.FileIO:
        """The lock file of ``path``, flock()ed (the lock goes with the returned file: closed, or dropped
        by an interrupted caller and closed by its deallocator)."""
        deadline = time.monotonic() + CAS_LOCK_TIMEOUT_S
        delay = 0.001
        while True:
            lock_path = self._lock_path(path)
            lock = open_owned(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                if time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
                    continue
                with suppress(FileNotFoundError):  # a holder frozen inside its swap: break the lock
                    os.rename(lock_path, unique_tmp_name(lock_path) + ".broken")
                deadline = time.monotonic() + CAS_LOCK_TIMEOUT_S
                continue
            except OSError:
                return lock  # a filesystem without locks: the version check still narrows the race
            if self._still_locked(lock.fileno(), path):
                return lock
            lock.close()  # the file was broken and replaced while we waited for it: lock the new one

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

    def delete_if_version(self, path: str, token: str, fence: Callable[[], None] | None = None) -> bool:
        """Under the lock that compare_and_swap takes: a writer that replaced the file since the
        caller read it keeps its version; ``fence`` runs last before the unlink."""
        lock = self._locked(path)
        try:
            current = self.read_versioned(path)
            if current is None or current[1] != token or not self._still_locked(lock.fileno(), path):
                return False
            if fence is not None:
                fence()
            unlink_quietly(path)
            fsync_dir(os.path.dirname(path))
            return True
        finally:
            lock.close()

    def publish(self, src: str, dst: str) -> None:
        self.rename_noreplace(src, dst)

    # -- data -----------------------------------------------------------------------
    def open_new(self, path: str) -> PosixWriteStream:
        return PosixWriteStream(path)

    def open_read(self, path: str) -> PosixReadHandle:
        return PosixReadHandle(path)

    def wait_visible(
        self, path: str, size: int | None = None, timeout: float = 30.0, stop_if: Callable[[], None] | None = None
    ) -> None:
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
                    "for longer than the timeout.",
                    path=path,
                )
            if stop_if is not None:
                stop_if()
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

    def prefetch(self, directory: str, prefix: str) -> Callable[[], None]:
        return read_ahead(directory, prefix)


def _fenced_or_raise(fence: Callable[[], None] | None) -> None:
    """The staged file of a swap vanished before its link or rename: a job that took the root over
    removed it (``PosixRoot.after_lease``); the fence then says so (LeaseLostError)."""
    if fence is not None:
        fence()


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
