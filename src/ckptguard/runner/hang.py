"""`ckptguard run --hang-timeout`: no progress for that long is a hang; every rank's stack says where.

Progress is any byte of output from the job, or a heartbeat (``ckptguard.runner.heartbeat()``,
called by every Checkpointer save and load): the modification time of the file named in
``CKPTGUARD_HEARTBEAT``. When neither comes for ``timeout_s``:

1. every Python process of the job dumps its stack, all threads, into ``stacks/`` of this run's
   log directory: the startup hook in ``_hook/`` (put on the job's PYTHONPATH) registered
   ``faulthandler`` for a real-time signal in each of them, so no privileges are needed (it works
   with ``ptrace_scope=1`` and in containers). Before the signal, each process's blocked system
   call is read from ``/proc/<pid>/syscall`` (allowed to the runner: it is their ancestor), which
   names the file a rank is stuck reading or opening. Where ``py-spy`` is installed and permitted,
   ``py-spy dump --native`` adds the native frames.
2. each rank's main thread is classified (``classify``): in a collective (which one), in the data
   loader, in I/O on a path, in a device call, or in user code; ``hang.json`` keeps it all;
3. the job is stopped: SIGTERM to everything it started, SIGKILL after the grace.

The rank that stopped is decided over every node's ``hang.json`` (``stopped_rank``), in the
report: the one not inside the collective the others wait in, else the odd one out.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

STACKS_DIR = "stacks"
HANG_FILE = "hang.json"
HEARTBEAT_FILE = ".heartbeat"
#: A real-time signal: no library or launcher gives it a meaning of its own (SIGUSR1/2 are the
#: users' and are forwarded to the job by the runner).
STACK_SIGNAL = signal.SIGRTMIN + 6
#: How long the processes get to write their stacks (faulthandler writes from the signal handler).
DUMP_WAIT_S = 3.0
PYSPY_TIMEOUT_S = 10.0
#: Names this run in the environment of every process it started: a process found by its stack
#: file outside the process tree (a double-forked helper) is signalled only when it carries it.
TOKEN_VAR = "CKPTGUARD_RUN_TOKEN"
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hook")

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(?P<current>Current thread|Thread) (?P<id>0x[0-9a-f]+)")

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


def child_env(env: Mapping[str, str], run_dir: str) -> dict[str, str]:
    """``env`` plus what the job's processes need for the stack dumps and the heartbeat."""
    out = dict(env)
    stacks = os.path.join(run_dir, STACKS_DIR)
    os.makedirs(stacks, exist_ok=True)
    out["CKPTGUARD_STACKS_DIR"] = stacks
    out["CKPTGUARD_STACK_SIGNAL"] = str(int(STACK_SIGNAL))
    out["CKPTGUARD_HEARTBEAT"] = os.path.join(run_dir, HEARTBEAT_FILE)
    out[TOKEN_VAR] = os.urandom(8).hex()
    path = out.get("PYTHONPATH")
    out["PYTHONPATH"] = HOOK_DIR + (os.pathsep + path if path else "")
    return out


@dataclass
class Proc:
    """One process of the job at the moment of the hang."""

    pid: int
    rank: int | None
    cmdline: str
    stack_file: str | None = None
    ppid: int | None = None
    wchan: str | None = None  # the kernel function it sleeps in (any process, hook or not)
    syscall: str | None = None  # "openat" etc. when blocked in one
    path: str | None = None  # the file that system call is on
    threads: list[list[dict[str, Any]]] = field(default_factory=list)
    native: str | None = None  # py-spy's output


class HangWatch:
    """The runner's clock: ``check`` is called from the output loop; it fires once."""

    def __init__(
        self, timeout_s: float, run_dir: str, checkpoints: str | None, grace_s: float, token: str | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self._token = token
        self.run_dir = run_dir
        self.checkpoints = checkpoints
        self.grace_s = grace_s
        self.heartbeat = os.path.join(run_dir, HEARTBEAT_FILE)
        self.last_progress = time.time()
        self.fired_at: float | None = None
        self._kill_at: float | None = None
        self._victims: list[tuple[int, str]] = []
        self._next_stat = 0.0

    def output(self) -> None:
        """Output arrived: progress."""
        self.last_progress = time.time()

    def check(self, pid: int) -> None:
        """Fire when the job has made no progress for the timeout; after firing, SIGKILL what is
        left once the grace is over."""
        now = time.time()
        if self.fired_at is not None:
            if self._kill_at is not None and now >= self._kill_at:
                self._kill_at = None
                _signal_all(self._victims, signal.SIGKILL)
            return
        if now < self._next_stat:
            return
        self._next_stat = now + min(0.5, self.timeout_s / 4)
        with contextlib.suppress(OSError):
            self.last_progress = max(self.last_progress, os.stat(self.heartbeat).st_mtime)
        if now - self.last_progress < self.timeout_s:
            return
        self.fired_at = now
        sys.stderr.write(
            f"ckptguard run: no output and no heartbeat from the job for {now - self.last_progress:.0f} s "
            f"(--hang-timeout {self.timeout_s:g}): capturing every rank's stack, then stopping it\n"
        )
        sys.stderr.flush()
        procs = descendants(pid)
        self._victims = [(p, _start_time(p)) for p in procs]
        self._victims += _registered_elsewhere(self.run_dir, set(procs), self._token)
        try:
            record = capture(procs, self.run_dir, self.checkpoints)
            record.update(timeout_s=self.timeout_s, last_progress_at=self.last_progress, detected_at=now)
            _write_json(os.path.join(self.run_dir, HANG_FILE), record)
            if not record["hook_ran"]:
                sys.stderr.write(
                    "ckptguard run: no process of the job ran ckptguard's startup hook (its PYTHONPATH was "
                    "replaced; keep ours: PYTHONPATH=.:$PYTHONPATH): no Python stack, only /proc was read\n"
                )
        except Exception as e:  # the job is stopped whatever the capture did
            sys.stderr.write(f"ckptguard run: could not capture the stacks ({type(e).__name__}: {e})\n")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        _signal_all(self._victims, signal.SIGTERM)
        self._kill_at = time.time() + self.grace_s

    def finish(self) -> None:
        """After the job's own process exited: what it left of a stopped job gets the rest of the
        grace, then SIGKILL."""
        if self._kill_at is None:
            return
        while time.time() < self._kill_at and any(_alive(p, s) for p, s in self._victims):
            time.sleep(0.1)
        self._kill_at = None
        _signal_all(self._victims, signal.SIGKILL)


def _write_json(path: str, data: Mapping[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()  # fields from the state on (the name may hold spaces)


def _start_time(pid: int) -> str:
    st = _stat_fields(pid)
    return st[19] if st is not None and len(st) > 19 else ""


def _alive(pid: int, started: str) -> bool:
    st = _stat_fields(pid)
    return st is not None and len(st) > 19 and st[0] != "Z" and st[19] == started


def _signal_all(victims: Iterable[tuple[int, str]], signum: int) -> None:
    for pid, started in victims:
        if _start_time(pid) == started:  # still the same process, not a reused pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def _environ(pid: int) -> dict[str, str]:
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


def _stack_files(run_dir: str) -> dict[int, tuple[int | None, str]]:
    """pid -> (rank or None, path) of every stack file the startup hook created in this run."""
    stacks = os.path.join(run_dir, STACKS_DIR)
    files: dict[int, tuple[int | None, str]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(stacks):
            m = re.fullmatch(r"(?:rank(\d+)_)?pid(\d+)(?:\.fork)?\.txt", name)
            if m:
                files[int(m.group(2))] = (int(m.group(1)) if m.group(1) else None, os.path.join(stacks, name))
    return files


def _registered_elsewhere(run_dir: str, tree: set[int], token: str | None) -> list[tuple[int, str]]:
    """Processes that ran the startup hook in this run but left its process tree (a double-forked
    helper, reparented to PID 1), still alive: pid and start time. Only those whose environment
    carries this run's token, so a pid reused by another process is never signalled."""
    if not token:
        return []
    out = []
    for pid in _stack_files(run_dir):
        if pid in tree:
            continue
        started = _start_time(pid)
        if started and _environ(pid).get(TOKEN_VAR) == token and _start_time(pid) == started:
            out.append((pid, started))
    return out


def _wchan(pid: int) -> str | None:
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
            st = _stat_fields(int(entry))
            if st and len(st) > 1:
                children.setdefault(int(st[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _catches(pid: int, signum: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _blocked_call(pid: int) -> tuple[str | None, str | None]:
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


def parse_dump(text: str) -> list[list[dict[str, Any]]]:
    """The threads of the last faulthandler dump in ``text``, each a list of frames innermost first
    (``{"file", "line", "func", "current"}``)."""
    threads: list[list[dict[str, Any]]] = []
    current = False
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            current = m.group("current") == "Current thread"
            threads.append([])
            continue
        f = _FRAME.match(line)
        if f and threads:
            threads[-1].append(
                {"file": f.group("file"), "line": int(f.group("line")), "func": f.group("func"), "current": current}
            )
    return [t for t in threads if t]


def capture(pids: list[int], run_dir: str, checkpoints: str | None) -> dict[str, Any]:
    """Dump the stacks of the job's Python processes into ``stacks/``; the record for ``hang.json``."""
    stacks = os.path.join(run_dir, STACKS_DIR)
    files = _stack_files(run_dir)
    procs: list[Proc] = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = " ".join(os.fsdecode(a) for a in f.read().split(b"\0") if a)
        except OSError:
            continue
        rank, path = files.get(pid, (None, None))
        if rank is None:  # the hook did not run, or the rank was not known to it
            env_rank = _environ(pid).get("RANK", "")
            rank = int(env_rank) if env_rank.isdigit() else None
        st = _stat_fields(pid)
        p = Proc(pid, rank, cmd, path, ppid=int(st[1]) if st and len(st) > 1 else None, wchan=_wchan(pid))
        p.syscall, p.path = _blocked_call(pid)
        procs.append(p)
    sizes = {}
    for p in procs:
        if p.stack_file is not None and _catches(p.pid, STACK_SIGNAL):
            sizes[p.pid] = _size(p.stack_file)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, STACK_SIGNAL)
    deadline = time.monotonic() + DUMP_WAIT_S
    stable = 0
    while time.monotonic() < deadline and sizes:
        time.sleep(0.1)
        now = {p.pid: _size(p.stack_file) for p in procs if p.pid in sizes and p.stack_file}
        if all(now[k] > sizes[k] for k in now) and stable >= 2:
            break
        stable = stable + 1 if all(now[k] > sizes[k] for k in now) else 0
    for p in procs:
        if p.stack_file is not None:
            with contextlib.suppress(OSError), open(p.stack_file, encoding="utf-8", errors="replace") as f:
                p.threads = parse_dump(f.read())
    _py_spy(procs, stacks)
    return {
        "host_pid": os.getpid(),
        "checkpoints": checkpoints,
        # False when no process of the job ran the startup hook (a launcher that replaced PYTHONPATH)
        "hook_ran": any(p.stack_file for p in procs),
        "processes": [_proc_json(p, checkpoints) for p in procs],
    }


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _py_spy(procs: list[Proc], stacks: str) -> None:
    """Native frames, where py-spy is installed and allowed to attach (optional)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return
    for p in procs:
        if p.stack_file is None:
            continue
        try:
            r = subprocess.run(
                [exe, "dump", "--native", "--pid", str(p.pid)],
                capture_output=True,
                text=True,
                timeout=PYSPY_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip():
            p.native = r.stdout
            with contextlib.suppress(OSError), open(os.path.splitext(p.stack_file)[0] + ".native.txt", "w") as f:
                f.write(r.stdout)


def _proc_json(p: Proc, checkpoints: str | None) -> dict[str, Any]:
    state, detail = classify(p.threads, p.syscall, p.path, checkpoints, wchan=p.wchan)
    return {
        "pid": p.pid,
        "ppid": p.ppid,
        "rank": p.rank,
        "wchan": p.wchan,
        "cmdline": p.cmdline[:500],
        "stack_file": p.stack_file,
        "syscall": p.syscall,
        "path": p.path,
        "state": state,
        "detail": detail,
        "threads": p.threads,
        "native": p.native is not None,
    }


_COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py",)
_DATA_FILES = ("torch/utils/data/",)
_DEVICE_FILES = ("torch/cuda/", "torch/xpu/", "torch/mps/")
_LIBRARY = re.compile(r"/lib/python\d[.\d]*/|<frozen |/site-packages/|/dist-packages/")


def main_thread(threads: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The main thread: the one whose outermost frame is a module's top level (a script's
    ``<module>``, ``runpy``), else the thread that took the signal."""
    tops = [t for t in threads if t[-1]["func"] == "<module>"]
    if tops:
        return tops[0]
    current = [t for t in threads if t[0]["current"]]
    return current[0] if current else (threads[0] if threads else [])


def classify(
    threads: list[list[dict[str, Any]]],
    syscall: str | None,
    path: str | None,
    checkpoints: str | None,
    wchan: str | None = None,
) -> tuple[str, str]:
    """Where a rank is: ``(state, detail)``, state one of ``io``, ``collective``, ``dataloader``,
    ``device``, ``user``, ``unknown`` (no stack). The main thread decides, except that a rank with
    any thread inside a collective (an async save's thread in ckptguard's protocol while the main
    thread waits for it) waits in that collective."""
    frames = main_thread(threads)
    if not frames:
        kernel = f"; blocked in {syscall}()" if syscall else ""
        kernel += f" on {path}" if syscall and path else ""
        kernel += f"; sleeping in the kernel in {wchan}" if wchan else ""
        return "unknown", "no Python stack (not a Python process, or it did not answer the signal)" + kernel
    where = _user_frame(frames)
    at = f"{where['func']} ({where['file']}:{where['line']})"
    in_data = any(any(d in f["file"] for d in _DATA_FILES) for f in frames)
    if syscall is not None and path is not None and path.startswith("/") and not path.startswith("/dev/"):
        ck = " (the checkpoint path)" if is_under(path, checkpoints) or _in_checkpointer(frames) else ""
        loader = ", inside the data loader" if in_data else ""
        return "io", f"blocked in {syscall}() on {path}{ck}{loader}, at {at}"
    for t in [frames] + [t for t in threads if t is not frames]:
        op = _collective(t)
        if op is not None:
            return "collective", op
    if in_data:
        return "dataloader", f"waiting for the next batch of the data loader, at {at}"
    for f in frames:
        if any(d in f["file"] for d in _DEVICE_FILES) or f["func"] in ("synchronize", "cuda_synchronize"):
            return "device", f"in a device call ({f['func']}), at {at}"
    return "user", f"in user code at {at}"


def _collective(frames: list[dict[str, Any]]) -> str | None:
    """The collective a thread waits in, or None."""
    for f in frames:
        if any(c in f["file"] for c in _COLLECTIVE_FILES) and not f["func"].startswith("_") and f["func"] != "wrapper":
            return str(f["func"])
        # DDP's collectives run inside the autograd engine (the gradient all-reduce in backward) and
        # in its forward (buffer broadcast): the Python stack ends there.
        if "torch/autograd/" in f["file"] and f["func"] in ("backward", "_engine_run_backward"):
            return "backward (DDP's gradient all-reduce)"
        if "torch/nn/parallel/distributed.py" in f["file"] and not f["func"].startswith("_"):
            return f"DDP {f['func']}"
    return None


def _in_checkpointer(frames: list[dict[str, Any]]) -> bool:
    return any("ckptguard/" in f["file"] and f["func"] in ("save", "load", "_save_now") for f in frames)


def is_under(path: str, root: str | None) -> bool:
    if not root or "://" in root:
        return False
    try:
        r = os.path.realpath(root)
        return os.path.commonpath([os.path.realpath(path), r]) == r
    except ValueError:
        return False


def _user_frame(frames: list[dict[str, Any]]) -> dict[str, Any]:
    for f in frames:
        if not _LIBRARY.search(f["file"]) and "ckptguard/" not in f["file"]:
            return f
    return frames[0]


@dataclass
class Verdict:
    """Which rank stopped, and how the job's hang is explained."""

    rank: int | None
    state: str
    detail: str
    waiting: list[int]
    others: list[int]  # other ranks that are not in the collective either
    collective: str | None
    text: str
    #: The process named when no rank is known (processes named by pid), else None.
    pid: int | None = None


def stopped_rank(records: list[Mapping[str, Any]]) -> Verdict:
    """Name the rank that stopped from every node's ``hang.json`` processes: the one not inside the
    collective the others wait in; when all wait in collectives, the odd one out (another
    collective); with no collective at all, the lowest rank (or the only process).

    When no process's rank is known (ranks started without a launcher and without
    ``init_process_group``, a Python wrapper running the job as a child), the processes whose
    stacks were captured are named by pid, leaving out those that only wait for a child process
    of the job (a launcher, a wrapper); one such process left is the job, as rank 0."""
    ranks: dict[int, Mapping[str, Any]] = {}
    unranked: list[Mapping[str, Any]] = []
    for rec in records:
        procs = [p for p in rec.get("processes") or [] if isinstance(p, Mapping)]
        parents = {p.get("ppid") for p in procs if p.get("threads")}
        for p in procs:
            r = p.get("rank")
            if isinstance(r, int) and not isinstance(r, bool):
                if r not in ranks or (p.get("threads") and not ranks[r].get("threads")):
                    ranks[r] = p
            elif p.get("threads") and not _forked(p) and not (p.get("pid") in parents and _waits_for_child(p)):
                unranked.append(p)
    by_pid = False
    if not ranks and len(unranked) == 1:  # a plain `python script.py`: the one process is the job
        ranks[0] = unranked[0]
        one = _verdict(ranks)
        one.pid = int(unranked[0].get("pid") or 0) or None
        if one.pid is not None:
            one.text += f" (process {one.pid}, the one process of the job not waiting for a child)"
        return one
    elif not ranks and unranked:
        by_pid = True
        ranks = {int(p.get("pid") or 0): p for p in unranked}
    if not ranks:
        return Verdict(
            None, "unknown", "no rank's stack was captured", [], [], None, "no rank's stack could be captured"
        )
    if not any(p.get("threads") for p in ranks.values()):  # the kernel's view only: no rank to name
        where = "; ".join(f"rank {r}: {_kernel_state(p)}" for r, p in sorted(ranks.items()))
        return Verdict(
            None,
            "unknown",
            "no Python stack was captured",
            [],
            sorted(ranks),
            None,
            f"no rank's Python stack was captured, so no rank can be named ({where})",
        )
    v = _verdict(ranks)
    if not by_pid:
        return v
    return Verdict(
        None,
        v.state,
        v.detail,
        v.waiting,
        v.others,
        v.collective,
        "no process's rank is known, so processes are named by pid: "
        + re.sub(r"\branks? (?=\d)", lambda m: "processes " if m.group(0).startswith("ranks") else "process ", v.text),
        pid=v.rank,
    )


_CHILD_WAITS = ("/subprocess.py", "multiprocessing/popen_", "multiprocessing/process.py", "torch/multiprocessing/")


def _forked(p: Mapping[str, Any]) -> bool:
    """A process forked (not exec'd) by another of the job and not a rank: a data-loader worker, a helper."""
    return str(p.get("stack_file") or "").endswith(".fork.txt")


def _waits_for_child(p: Mapping[str, Any]) -> bool:
    """The process's main thread waits for a child process (a wrapper, a launcher)."""
    raw = p.get("threads")
    frames = main_thread([t for t in raw if isinstance(t, list) and t] if isinstance(raw, list) else [])
    return any(any(w in str(f.get("file")) for w in _CHILD_WAITS) or f.get("func") == "waitpid" for f in frames)


def _kernel_state(p: Mapping[str, Any]) -> str:
    if p.get("syscall"):
        return f"blocked in {p.get('syscall')}()" + (f" on {p.get('path')}" if p.get("path") else "")
    return f"sleeping in {p.get('wchan')}" if p.get("wchan") else "state unknown"


def _verdict(ranks: Mapping[int, Mapping[str, Any]]) -> Verdict:
    in_coll = {r: str(p.get("detail")) for r, p in ranks.items() if p.get("state") == "collective"}
    outside = sorted(r for r in ranks if r not in in_coll)
    ops = Counter(in_coll.values())
    if in_coll and outside:
        main_op = ops.most_common(1)[0][0]
        stopped = outside[0]
        waiting = sorted(r for r, op in in_coll.items() if op == main_op)
        p = ranks[stopped]
        return Verdict(
            stopped,
            str(p.get("state")),
            str(p.get("detail")),
            waiting,
            outside[1:],
            main_op,
            f"rank {stopped} is not in the collective {main_op} that {_ranks(waiting)} {_wait(waiting)} in: "
            f"it is {p.get('detail')}",
        )
    if len(ops) > 1:
        main_op, _ = ops.most_common(1)[0]
        odd = sorted(r for r, op in in_coll.items() if op != main_op)
        tie = ops.most_common()[0][1] == ops.most_common()[1][1]
        if tie:  # no majority: a point-to-point call is the odd one out, else the lowest rank's call
            p2p = [op for op in ops if op in _P2P]
            odd_op = p2p[0] if len(p2p) == 1 else in_coll[min(in_coll)]
            main_op = next(op for op, _ in ops.most_common() if op != odd_op)
            odd = sorted(r for r, op in in_coll.items() if op == odd_op)
        stopped = odd[0]
        waiting = sorted(r for r, op in in_coll.items() if op == main_op)
        return Verdict(
            stopped,
            "other_collective",
            in_coll[stopped],
            waiting,
            odd[1:],
            main_op,
            f"rank {stopped} waits in {in_coll[stopped]} while {_ranks(waiting)} {_wait(waiting)} in "
            f"{main_op}: the ranks called different collectives"
            + (" (as many ranks in each: the odd one out is a guess)" if tie else ""),
        )
    if in_coll:
        op = next(iter(ops))
        return Verdict(
            None,
            "collective",
            op,
            sorted(in_coll),
            [],
            op,
            f"every rank captured ({_ranks(sorted(in_coll))}) waits in {op}: the rank they wait for "
            "is not among them (another node whose stacks are missing, or a rank that exited)",
        )
    stopped = outside[0]
    p = ranks[stopped]
    return Verdict(
        stopped,
        str(p.get("state")),
        str(p.get("detail")),
        [],
        outside[1:],
        None,
        f"rank {stopped} is {p.get('detail')}"
        + (f" (as {'is' if len(outside) == 2 else 'are'} {_ranks(outside[1:])})" if outside[1:] else ""),
    )


_P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}


def _wait(rs: list[int]) -> str:
    return "waits" if len(rs) == 1 else "wait"


def _ranks(rs: list[int]) -> str:
    if not rs:
        return "no rank"
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def read_hang(run_dir: str) -> dict[str, Any] | None:
    """This run's ``hang.json``, or None (absent, unreadable, or not an object)."""
    try:
        with open(os.path.join(run_dir, HANG_FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def stack_text(threads: list[list[dict[str, Any]]]) -> str:
    """A rank's threads as text, innermost frame first (the dump's own order)."""
    out = []
    for t in threads:
        frames = [f for f in t if isinstance(f, dict)] if isinstance(t, list) else []
        if not frames:
            continue
        out.append(
            "Current thread (most recent call first):"
            if frames[0].get("current")
            else "Thread (most recent call first):"
        )
        out += [f'  File "{f.get("file")}", line {f.get("line")} in {f.get("func")}' for f in frames]
    return "\n".join(out)
