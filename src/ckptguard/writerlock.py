"""One writer per file path, across processes and hosts: ``save_file``'s lock file next to the file it
replaces, broken at once when its holder died on this host, and the atomic replace made under it.

The temporary file of a replace names its writer (host tag, pid), so the next writer removes those
a killed writer left, and nothing else beside the file is touched.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import time
from contextlib import suppress

from ckptguard.checksum import checksum
from ckptguard.errors import CheckpointError, from_os_error
from ckptguard.storage.fileio import open_owned, open_regular, replace_file, unlink_quietly, write_all

#: A lock file stays empty only between its creation and the write of its token (microseconds);
#: one empty for longer was left by a writer that failed or died in between.
EMPTY_LOCK_S = 10.0


def _tmp_prefix(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-")


def _host_tag() -> str:
    """This host, as a file-name-safe tag (a hostname may hold any character)."""
    return checksum("xxh3-64", socket.gethostname().encode())[:8]


_TMP_NAME = re.compile(r"([0-9a-f]{8})-(\d{1,9})-[0-9a-f]{12}")


def replace_locked(path: str, data: bytes) -> None:
    """Replace ``path`` atomically (temporary file, fsync, rename, fsync of the directory), holding its
    writer lock. The temporary file names its writer (host tag, pid) so that the next writer removes
    those a killed writer left; nothing else beside ``path`` is touched."""
    _remove_dead_writers_tmp(path)
    replace_file(path, data, tmp=f"{_tmp_prefix(path)}{_host_tag()}-{os.getpid()}-{os.urandom(6).hex()}")


def _remove_dead_writers_tmp(path: str) -> None:
    """``.NAME.tmp-HOST-PID-*`` regular files of writers on this host whose process is gone."""
    prefix = _tmp_prefix(path)
    directory, start = os.path.split(prefix)
    with suppress(OSError):
        for name in os.listdir(directory or "."):
            m = _TMP_NAME.fullmatch(name[len(start) :]) if name.startswith(start) else None
            if m is None or m.group(1) != _host_tag() or not _pid_dead(int(m.group(2))):
                continue
            full = os.path.join(directory, name)
            with suppress(OSError):
                if stat.S_ISREG(os.lstat(full).st_mode):
                    os.unlink(full)


def _pid_dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


class WriterLock:
    """``path + ".lock"``, created exclusively: one writer of ``path`` at a time, across processes and hosts.

    The lock records host and pid; one left by a process that died on this host is broken at once,
    one held elsewhere is waited for (``timeout_s``), then refused naming its holder.
    """

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path + ".lock"
        self.timeout_s = timeout_s
        self.token = f"{socket.gethostname()} {os.getpid()} {os.urandom(8).hex()}"

    def __enter__(self) -> WriterLock:
        deadline = time.monotonic() + self.timeout_s
        delay = 0.005
        while True:
            try:
                owner = open_owned(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, "create")
            except FileExistsError:
                self._refuse_if_not_a_file()
                holder = self._holder()
                if (holder is not None and self._dead(holder)) or (
                    (holder is None or not self._parses(holder)) and self._abandoned_empty()
                ):
                    self._break(holder or "")
                    continue
                if time.monotonic() >= deadline:
                    from ckptguard.errors import PathCollisionError

                    raise PathCollisionError(
                        f"{self.path[:-5]} is being written by another process ({holder or 'unknown holder'}) "
                        f"for more than {self.timeout_s:.0f} s. If no process writes it any more, remove "
                        f"{self.path}.",
                        path=self.path[:-5],
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
                continue
            except OSError as e:
                raise from_os_error(e, self.path) from e
            try:
                with owner:
                    write_all(owner.fileno(), [memoryview(self.token.encode())])
            except OSError as e:  # disk full: leave no lock that no one would ever break
                unlink_quietly(self.path)
                raise from_os_error(e, self.path[:-5]) from e
            return self

    def __exit__(self, *exc: object) -> None:
        if self._holder() == self.token:
            unlink_quietly(self.path)

    def _holder(self) -> str | None:
        return _read_token(self.path)

    def _refuse_if_not_a_file(self) -> None:
        """A directory, FIFO or link where the lock goes is the user's, not a lock: never broken (renamed)."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        except OSError as e:
            raise from_os_error(e, self.path) from e
        if not stat.S_ISREG(mode):
            from ckptguard.errors import PathCollisionError

            raise PathCollisionError(
                f"{self.path} is not a lock file (a directory, FIFO or link is there): save_file of "
                f"{self.path[:-5]} needs that name for its writer lock. Move it away, or save under another name.",
                path=self.path,
            )

    @staticmethod
    def _parses(holder: str) -> bool:
        """Whether a token names a host and a pid, as every token ckptguard writes does."""
        parts = holder.split()
        return len(parts) >= 2 and parts[1].isdigit() and len(parts[1]) <= 9

    def _abandoned_empty(self) -> bool:
        """An empty (or unreadable) lock older than EMPTY_LOCK_S: its creator never wrote its token."""
        try:
            return time.time() - os.lstat(self.path).st_mtime > EMPTY_LOCK_S
        except OSError:
            return False

    @staticmethod
    def _dead(holder: str) -> bool:
        # "host pid" is enough: a token cut short after the pid still names its creator.
        parts = holder.split()
        if len(parts) < 2 or parts[0] != socket.gethostname() or not parts[1].isdigit() or len(parts[1]) > 9:
            return False
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _break(self, holder: str) -> None:
        # Rename first, so that two processes breaking the same stale lock cannot remove a new one.
        aside = f"{self.path}.stale.{os.urandom(4).hex()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(os.lstat(aside).st_mode):  # replaced by a directory meanwhile: the user's
            os.rename(aside, self.path)
            self._refuse_if_not_a_file()
        try:
            if (_read_token(aside) or "") != holder:  # someone else's fresh lock: put it back if we can
                with suppress(OSError):
                    os.link(aside, self.path)
        finally:
            unlink_quietly(aside)


def _read_token(path: str) -> str | None:
    """A lock's token; None if empty or unreadable (never blocks on a FIFO, never follows a link)."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            return f.read(512).decode("utf-8", "replace").strip() or None
    except (OSError, CheckpointError):
        return None
