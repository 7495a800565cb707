"""Every rank's stack at a hang: the startup hook's faulthandler dumps, ``/proc`` and py-spy.

The startup hook in ``_hook/`` (put on the job's PYTHONPATH) registers ``faulthandler`` for a
real-time signal in every Python process of the job, so no privileges are needed (it works with
``ptrace_scope=1`` and in containers). Before the signal, each process's blocked system call is
read from ``/proc/<pid>/syscall``, which names the file a rank is stuck reading or opening. Where
``py-spy`` is installed and permitted, ``py-spy dump --native`` adds the native frames.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from ckptguard.runner.procfs import blocked_call, catches, environ, start_time, stat_fields, wchan
from ckptguard.runner.rankstate import classify

STACKS_DIR = "stacks"
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


def stack_files(run_dir: str) -> dict[int, tuple[int | None, str]]:
    """pid -> (rank or None, path) of every stack file the startup hook created in this run."""
    stacks = os.path.join(run_dir, STACKS_DIR)
    files: dict[int, tuple[int | None, str]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(stacks):
            m = re.fullmatch(r"(?:rank(\d+)_)?pid(\d+)(?:\.fork)?\.txt", name)
            if m:
                files[int(m.group(2))] = (int(m.group(1)) if m.group(1) else None, os.path.join(stacks, name))
    return files


def registered_elsewhere(run_dir: str, tree: set[int], token: str | None) -> list[tuple[int, str]]:
    """Processes that ran the startup hook in this run but left its process tree (a double-forked
    helper, reparented to PID 1), still alive: pid and start time. Only those whose environment
    carries this run's token, so a pid reused by another process is never signalled."""
    if not token:
        return []
    out = []
    for pid in stack_files(run_dir):
        if pid in tree:
            continue
        started = start_time(pid)
        if started and environ(pid).get(TOKEN_VAR) == token and start_time(pid) == started:
            out.append((pid, started))
    return out


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
    files = stack_files(run_dir)
    procs: list[Proc] = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = " ".join(os.fsdecode(a) for a in f.read().split(b"\0") if a)
        except OSError:
            continue
        rank, path = files.get(pid, (None, None))
        if rank is None:  # the hook did not run, or the rank was not known to it
            env_rank = environ(pid).get("RANK", "")
            rank = int(env_rank) if env_rank.isdigit() else None
        st = stat_fields(pid)
        p = Proc(pid, rank, cmd, path, ppid=int(st[1]) if st and len(st) > 1 else None, wchan=wchan(pid))
        p.syscall, p.path = blocked_call(pid)
        procs.append(p)
    sizes = {}
    for p in procs:
        if p.stack_file is not None and catches(p.pid, STACK_SIGNAL):
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
