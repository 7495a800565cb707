"""`ckptguard run --hang-timeout`: no progress for that long is a hang; every rank's stack says where.

Progress is any byte of output from the job, or a heartbeat (``ckptguard.runner.heartbeat()``,
called by every Checkpointer save and load): the modification time of the file named in
``CKPTGUARD_HEARTBEAT``. When neither comes for ``timeout_s`` (``HangWatch``):

1. every Python process of the job dumps its stack, all threads, into ``stacks/`` of this run's
   log directory (``stacks.capture``);
2. each rank's main thread is classified (``rankstate.classify``): in a collective (which one), in
   the data loader, in I/O on a path, in a device call, or in user code; ``hang.json`` keeps it all;
3. the job is stopped: SIGTERM to everything it started, SIGKILL after the grace.

The rank that stopped is decided over every node's ``hang.json`` (``verdict.stopped_rank``), in the
report: the one not inside the collective the others wait in, else the odd one out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from ckptguard.errors import CheckpointError
from ckptguard.files import read_json
from ckptguard.runner.procfs import alive, descendants, signal_all, start_time
from ckptguard.runner.rankstate import classify, is_under, main_thread
from ckptguard.runner.stacks import (
    DUMP_WAIT_S,
    HOOK_DIR,
    PYSPY_TIMEOUT_S,
    STACK_SIGNAL,
    STACKS_DIR,
    TOKEN_VAR,
    Proc,
    capture,
    parse_dump,
    registered_elsewhere,
    stack_text,
)
from ckptguard.runner.verdict import Verdict, stopped_rank

__all__ = [
    "DUMP_WAIT_S",
    "HANG_FILE",
    "HEARTBEAT_FILE",
    "HOOK_DIR",
    "PYSPY_TIMEOUT_S",
    "STACKS_DIR",
    "STACK_SIGNAL",
    "TOKEN_VAR",
    "HangWatch",
    "Proc",
    "Verdict",
    "capture",
    "child_env",
    "classify",
    "descendants",
    "is_under",
    "main_thread",
    "parse_dump",
    "read_hang",
    "stack_text",
    "stopped_rank",
]

HANG_FILE = "hang.json"
HEARTBEAT_FILE = ".heartbeat"


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
                signal_all(self._victims, signal.SIGKILL)
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
        self._victims = [(p, start_time(p)) for p in procs]
        self._victims += registered_elsewhere(self.run_dir, set(procs), self._token)
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
        signal_all(self._victims, signal.SIGTERM)
        self._kill_at = time.time() + self.grace_s

    def finish(self) -> None:
        """After the job's own process exited: what it left of a stopped job gets the rest of the
        grace, then SIGKILL."""
        if self._kill_at is None:
            return
        while time.time() < self._kill_at and any(alive(p, s) for p, s in self._victims):
            time.sleep(0.1)
        self._kill_at = None
        signal_all(self._victims, signal.SIGKILL)


def _write_json(path: str, data: Mapping[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def read_hang(run_dir: str) -> dict[str, Any] | None:
    """This run's ``hang.json``, or None (absent, unreadable, or not an object)."""
    try:
        data = read_json(os.path.join(run_dir, HANG_FILE), "hang record")
    except (OSError, CheckpointError):
        return None
    return data if isinstance(data, dict) else None
