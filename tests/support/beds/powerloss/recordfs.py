"""A pass-through FUSE file system that records every operation that changes what a disk holds.

Run as a process of its own (``python recordfs.py BACKING MOUNTPOINT LOGDIR``), mounted
in the foreground and single-threaded (``-s``): requests are served one at a time, in the
order the kernel hands them over, so the recorded order is the order in which the
operations took effect, also when several ranks and threads write at once.

What is recorded (between a ``start`` and a ``stop`` control, see below), with inode ids
of our own (``ino``) so that an operation on an open file or on a directory is tied to the
object, not to a path that a later rename changes:

* entry operations, each on its parent directory's id: ``create``, ``mkdir``, ``symlink``,
  ``link``, ``unlink``, ``rmdir``, ``rename`` (with its flags);
* data operations: ``write`` (offset and bytes, kept in ``data.bin``), ``truncate``;
* durability operations: ``fsync`` / ``fdatasync`` of a file, ``fsyncdir`` of a directory;
* ``mark``s, the control points the scenario sets (e.g. "save() returned here").

Reads, ``flush`` (close) and attribute changes (chmod, utimens) are not recorded: they do
not change what a crash can leave. At ``start`` the backing directory is snapshotted
(``initial.json``): the state before the recorded part, taken as fully durable.

Control without a side channel: the scenario looks up a name ``/.plctl-<cmd>-<label>``
under the mount (``os.path.lexists``); the lookup is answered ENOENT and acts on ``cmd``:
``start`` (snapshot, begin recording), ``mark`` (a mark labelled ``label``), ``stop``
(end recording and write the log). The recorder process is the only writer of the
backing directory while mounted.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from typing import Any

# mfusepy prefers libfuse 2 where both are installed; RENAME_NOREPLACE needs libfuse 3's rename.
os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
import mfusepy

CONTROL_PREFIX = ".plctl-"
_RENAME_NOREPLACE = 1


class _FUSE(mfusepy.FUSE):
    """mfusepy 3.1.1 drops rename's flags (RENAME_NOREPLACE would silently replace): pass them on."""

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return self.operations.rename2(
            old.decode(self.encoding, self.errors), new.decode(self.encoding, self.errors), flags
        )


class Recorder(mfusepy.Operations):
    """Loopback operations over ``backing``, recording what changes the disk."""

    use_ns = True

    def __init__(self, backing: str, logdir: str) -> None:
        self.backing = os.path.realpath(backing)
        self.logdir = logdir
        self.recording = False
        self.ops: list[dict[str, Any]] = []
        self.ino: dict[int, int] = {}  # backing st_ino -> our id
        self.next_id = 1
        self.data: Any = None
        self.data_off = 0
        self.seen_controls: set[str] = set()
        self.session = 0

    # -- helpers ------------------------------------------------------------------------
    def _full(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _new_id(self, real_ino: int) -> int:
        i = self.next_id
        self.next_id += 1
        self.ino[real_ino] = i
        return i

    def _id_of_path(self, path: str) -> int:
        st = os.lstat(self._full(path))
        if st.st_ino not in self.ino:
            return self._new_id(st.st_ino)
        return self.ino[st.st_ino]

    def _id_of_fh(self, fh: int) -> int:
        st = os.fstat(fh)
        if st.st_ino not in self.ino:
            return self._new_id(st.st_ino)
        return self.ino[st.st_ino]

    def _parent(self, path: str) -> tuple[int, str]:
        head, name = os.path.split(path.rstrip("/"))
        return self._id_of_path(head or "/"), name

    def _blob(self, data: bytes) -> tuple[int, int]:
        off = self.data_off
        self.data.write(data)
        self.data_off += len(data)
        return off, len(data)

    def _rec(self, **op: Any) -> None:
        if self.recording:
            self.ops.append(op)

    # -- control ------------------------------------------------------------------------
    def _control(self, name: str) -> None:
        if name in self.seen_controls:
            return
        self.seen_controls.add(name)
        cmd, _, label = name[len(CONTROL_PREFIX) :].partition("-")
        label = label.rsplit(".", 1)[0]  # drop the nonce that makes each lookup a new name
        if cmd == "start":
            self._start(label)
        elif cmd == "mark" and self.recording:
            self.ops.append({"op": "mark", "label": label})
        elif cmd == "stop" and self.recording:
            self._stop()

    def _start(self, label: str) -> None:
        self.session += 1
        self.ops = []
        self.ino = {}
        self.next_id = 1
        self.data = open(os.path.join(self.logdir, "data.bin"), "wb")  # noqa: SIM115 (closed at stop)
        self.data_off = 0
        inodes: dict[int, dict[str, Any]] = {}

        def walk(real: str) -> int:
            st = os.lstat(real)
            known = st.st_ino in self.ino
            i = self.ino[st.st_ino] if known else self._new_id(st.st_ino)
            if known:
                return i
            if stat.S_ISDIR(st.st_mode):
                inodes[i] = {
                    "kind": "dir",
                    "entries": {n: walk(os.path.join(real, n)) for n in sorted(os.listdir(real))},
                }
            elif stat.S_ISLNK(st.st_mode):
                inodes[i] = {"kind": "symlink", "target": os.readlink(real)}
            else:
                with open(real, "rb") as f:
                    inodes[i] = {"kind": "file", "blob": self._blob(f.read())}
            return i

        root = walk(self.backing)
        with open(os.path.join(self.logdir, "initial.json"), "w") as f:
            json.dump({"label": label, "root": root, "inodes": inodes}, f)
        self.recording = True

    def _stop(self) -> None:
        self.recording = False
        self.data.close()
        with open(os.path.join(self.logdir, "ops.jsonl"), "w") as f:
            for op in self.ops:
                f.write(json.dumps(op) + "\n")
        with open(os.path.join(self.logdir, "done"), "w") as f:
            f.write(str(len(self.ops)))

    # -- reading (not recorded) ------------------------------------------------------------
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        base = os.path.basename(path)
        if base.startswith(CONTROL_PREFIX):
            self._control(base)
            raise mfusepy.FuseOSError(errno.ENOENT)
        st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
        out = {
            k: getattr(st, k)
            for k in (
                "st_mode",
                "st_ino",
                "st_nlink",
                "st_uid",
                "st_gid",
                "st_size",
                "st_atime_ns",
                "st_mtime_ns",
                "st_ctime_ns",
                "st_blocks",
            )
        }
        out["st_atime"], out["st_mtime"], out["st_ctime"] = (
            out.pop("st_atime_ns"),
            out.pop("st_mtime_ns"),
            out.pop("st_ctime_ns"),
        )
        return out

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        # With use_ino, an entry's inode number must be given: glibc skips entries whose d_ino is 0.
        full = self._full(path)
        out = []
        for name in [".", "..", *os.listdir(full)]:
            st = os.lstat(os.path.join(full, name))
            out.append((name, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0))
        return out

    def readlink(self, path: str) -> str:
        return os.readlink(self._full(path))

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._full(path))
        return {
            k: getattr(sv, k)
            for k in (
                "f_bavail",
                "f_bfree",
                "f_blocks",
                "f_bsize",
                "f_favail",
                "f_ffree",
                "f_files",
                "f_flag",
                "f_frsize",
                "f_namemax",
            )
        }

    def open(self, path: str, flags: int) -> int:
        fd = os.open(self._full(path), flags & ~os.O_CREAT)
        if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
            self._rec(op="truncate", ino=self._id_of_fh(fd), size=0)
        return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def opendir(self, path: str) -> int:
        return 0

    def releasedir(self, path: str, fh: int) -> int:
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    # -- data ---------------------------------------------------------------------------
    def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:
        parent, name = self._parent(path)
        fd = os.open(self._full(path), (flags & ~os.O_TRUNC) | os.O_CREAT | os.O_EXCL, mode)
        if self.recording:
            self._rec(op="create", parent=parent, name=name, ino=self._new_id(os.fstat(fd).st_ino))
        return fd

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        n = os.pwrite(fh, data, offset)
        if self.recording:
            off, ln = self._blob(data[:n])
            self._rec(op="write", ino=self._id_of_fh(fh), off=offset, blob=[off, ln])
        return n

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        if fh is not None:
            os.ftruncate(fh, length)
            ident = self._id_of_fh(fh) if self.recording else 0
        else:
            os.truncate(self._full(path), length)
            ident = self._id_of_path(path) if self.recording else 0
        self._rec(op="truncate", ino=ident, size=length)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        # The backing copy's durability is irrelevant: the crash states are built from the log.
        if self.recording:
            self._rec(op="fsync", ino=self._id_of_fh(fh), datasync=bool(datasync))
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        if self.recording:
            self._rec(op="fsyncdir", ino=self._id_of_path(path))
        return 0

    # -- entries ------------------------------------------------------------------------
    def mkdir(self, path: str, mode: int) -> int:
        parent, name = self._parent(path)
        os.mkdir(self._full(path), mode)
        if self.recording:
            self._rec(op="mkdir", parent=parent, name=name, ino=self._new_id(os.lstat(self._full(path)).st_ino))
        return 0

    def symlink(self, target: str, source: str) -> int:
        parent, name = self._parent(target)
        os.symlink(source, self._full(target))
        if self.recording:
            self._rec(
                op="symlink",
                parent=parent,
                name=name,
                target=source,
                ino=self._new_id(os.lstat(self._full(target)).st_ino),
            )
        return 0

    def link(self, target: str, source: str) -> int:
        parent, name = self._parent(target)
        ident = self._id_of_path(source)
        os.link(self._full(source), self._full(target))
        self._rec(op="link", parent=parent, name=name, ino=ident)
        return 0

    def unlink(self, path: str) -> int:
        parent, name = self._parent(path)
        ident = self._id_of_path(path)
        os.unlink(self._full(path))
        self._rec(op="unlink", parent=parent, name=name, ino=ident)
        return 0

    def rmdir(self, path: str) -> int:
        parent, name = self._parent(path)
        ident = self._id_of_path(path)
        os.rmdir(self._full(path))
        self._rec(op="rmdir", parent=parent, name=name, ino=ident)
        return 0

    def rename(self, old: str, new: str) -> int:
        return self.rename2(old, new, 0)

    def rename2(self, old: str, new: str, flags: int) -> int:
        sparent, sname = self._parent(old)
        dparent, dname = self._parent(new)
        ident = self._id_of_path(old)
        if flags & ~_RENAME_NOREPLACE:
            raise mfusepy.FuseOSError(errno.EINVAL)
        if flags & _RENAME_NOREPLACE and os.path.lexists(self._full(new)):
            raise mfusepy.FuseOSError(errno.EEXIST)
        os.rename(self._full(old), self._full(new))
        self._rec(op="rename", sparent=sparent, sname=sname, dparent=dparent, dname=dname, ino=ident, flags=flags)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.lchown(self._full(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(self._full(path), ns=times, follow_symlinks=False)
        return 0

    def destroy(self, path: str) -> None:
        if self.recording:
            self._stop()


def main(argv: list[str]) -> None:
    backing, mountpoint, logdir = argv
    if mfusepy.fuse_version_major != 3:
        raise SystemExit(f"recordfs needs libfuse 3 (mfusepy loaded libfuse {mfusepy.fuse_version_major})")
    ops = Recorder(backing, logdir)
    # hard_remove: an unlinked open file is really unlinked (libfuse would otherwise rename it
    # to .fuse_hidden*, an operation the library never issued); use_ino: the backing inode
    # numbers show through (os.link, st_ino comparisons behave as on a real disk).
    _FUSE(
        ops,
        mountpoint,
        foreground=True,
        nothreads=True,
        hard_remove=True,
        use_ino=True,
        default_permissions=True,
        fsname="powerloss",
        subtype="powerloss",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
