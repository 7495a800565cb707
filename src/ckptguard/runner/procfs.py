"""What `/proc` says of the job's processes at a hang: the tree, start times, blocked system calls.

The runner reads these of its own descendants (allowed to an ancestor without privileges, also with
``ptrace_scope=1``). A process is signalled only while its start time is unchanged, so a pid that a
new process reused is never hit.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterable

# x86_64 and aarch64 system call numbers: (name, index of the path argument or of the fd argument).
_PATH_CALLS = {
    "x86_64": {
        2: ("open", 0),
        257: ("openat", 1),
        4: ("stat", 0),
        6: ("lstat", 0),
        262: ("newfstatat", 1),
        332: ("statx", 1),
        21: ("access", 0),
        269: ("faccessat", 1),
        258: ("mkdirat", 1),
        263: ("unlinkat", 1),
        82: ("rename", 0),
        264: ("renameat", 1),
        316: ("renameat2", 1),
    },
    "aarch64": {
        56: ("openat", 1),
        79: ("newfstatat", 1),
        291: ("statx", 1),
        48: ("faccessat", 1),
        34: ("mkdirat", 1),
        35: ("unlinkat", 1),
        38: ("renameat", 1),
        276: ("renameat2", 1),
    },
}
_FD_CALLS = {
    "x86_64": {
        0: "read",
        1: "write",
        17: "pread64",
        18: "pwrite64",
        19: "readv",
        20: "writev",
        74: "fsync",
        75: "fdatasync",
        73: "flock",
        77: "ftruncate",
        217: "getdents64",
    },
    "aarch64": {
        63: "read",
        64: "write",
        67: "pread64",
        68: "pwrite64",
        65: "readv",
        66: "writev",
        82: "fsync",
        83: "fdatasync",
        32: "flock",
        46: "ftruncate",
        61: "getdents64",
    },
}


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state on, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()  # fields from the state on (the name may hold spaces)


def start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' when gone): with the pid, it names one process."""
    st = stat_fields(pid)
    return st[19] if st is not None and len(st) > 19 else ""


def alive(pid: int, started: str) -> bool:
    """Whether the process that started at ``started`` still runs (not a zombie, not a reused pid)."""
    st = stat_fields(pid)
    return st is not None and len(st) > 19 and st[0] != "Z" and st[19] == started


def signal_all(victims: Iterable[tuple[int, str]], signum: int) -> None:
    """Send ``signum`` to each ``(pid, start time)`` that is still that same process."""
    for pid, started in victims:
        if start_time(pid) == started:  # still the same process, not a reused pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def environ(pid: int) -> dict[str, str]:
    """The process's environment ({} when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[os.fsdecode(k)] = os.fsdecode(v)
    return out


def wchan(pid: int) -> str | None:
    """The kernel function the process sleeps in, or None."""
    try:
        with open(f"/proc/{pid}/wchan", encoding="ascii", errors="replace") as f:
            w = f.read().strip()
    except OSError:
        return None
    return w if w and w != "0" else None


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (launchers start their workers in new sessions, so the
    process tree, not the session, is what the job is)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = stat_fields(int(entry))
            if st and len(st) > 1:
                children.setdefault(int(st[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (a dump signal to one without kills it)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def blocked_call(pid: int) -> tuple[str | None, str | None]:
    """The file system call ``pid``'s main thread is blocked in, and its path (None, None if not
    in one, or not readable)."""
    arch = platform.machine()
    try:
        with open(f"/proc/{pid}/syscall", encoding="ascii") as f:
            parts = f.read().split()
    except OSError:
        return None, None
    if not parts or not parts[0].isdigit():
        return None, None
    nr, args = int(parts[0]), [int(a, 16) for a in parts[1:7]]
    if nr in _FD_CALLS.get(arch, {}):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{args[0]}")
        except OSError:
            return _FD_CALLS[arch][nr], None
        return _FD_CALLS[arch][nr], target
    if nr in _PATH_CALLS.get(arch, {}):
        name, i = _PATH_CALLS[arch][nr]
        return name, _read_c_string(pid, args[i])
    return None, None


def _read_c_string(pid: int, address: int) -> str | None:
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(address)
            raw = f.read(4096)
    except (OSError, OverflowError, ValueError):
        return None
    path = os.fsdecode(raw.split(b"\0", 1)[0])
    if path and not os.path.isabs(path):
        with contextlib.suppress(OSError):
            path = os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)
    return path or None
