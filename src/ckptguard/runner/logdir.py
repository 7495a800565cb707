"""The log directory of `ckptguard run`: one subdirectory per host and run, found again by job.

``--logs DIR`` may be shared by every node of a job (shared storage) and reused by later jobs.
Each runner writes only into its own ``DIR/<start time>_<host>_<pid>/``: ``stdout.log``,
``stderr.log`` (what the child printed), their ``.*.times`` (arrival times), ``run.json`` (host,
command, job id, start, end, status) and, after a failure, ``report.json`` and ``report.html``.

Which subdirectories belong to one job: those with the same job id (``--job-id``, else the
scheduler's: ``SLURM_JOB_ID``, ``PBS_JOBID``, ``LSB_JOBID``, ``JOB_ID``, ``TORCHELASTIC_RUN_ID``,
``PET_RDZV_ID``); without one on both sides, those whose runs overlapped in time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ckptguard.errors import CheckpointError
from ckptguard.files import read_json

RUN_FILE = "run.json"
#: ``exit.log``: what the runner itself saw of the child's end (a death by signal), written as a
#: launcher's exit line that the diagnosis engine reads like any other.
EXIT_LOG = "exit.log"
LOG_NAMES = ("stdout.log", "stderr.log", EXIT_LOG)
JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "TORCHELASTIC_RUN_ID", "PET_RDZV_ID")
#: A run that never recorded its end counts as still running while its logs grew this recently.
STALE_S = 60.0


class LogDirError(Exception):
    """The log directory cannot be created or written."""


class RunRecord(msgspec.Struct, frozen=True):
    """The fields of ``run.json`` and their types. A ``run.json`` read back (from another node, or
    one handed to `diagnose`) may hold anything: a field of the wrong type is dropped with a
    warning, never a reason to lose the whole job's diagnosis."""

    host: str = "?"
    pid: int | None = None
    command: list[str] = []
    job_id: str | None = None
    cwd: str | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    exit_status: int | None = None
    attempt: int = 1
    signals_forwarded: list[int] = []
    error: str | None = None
    report_json: str | None = None
    report_html: str | None = None
    hang_detected_at: float | None = None
    hang_timeout_s: float | None = None
    attempts: list[dict[str, Any]] = []


_RECORD_TYPES = {f.name: f.type for f in msgspec.structs.fields(RunRecord)}


def typed_record(raw: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """``raw`` with every known field checked against ``RunRecord``: the fields that pass, and one
    warning per field dropped. Unknown fields are kept (a newer runner's)."""
    out: dict[str, Any] = {}
    warnings = []
    for key, value in raw.items():
        typ = _RECORD_TYPES.get(key)
        if typ is None:
            out[key] = value
            continue
        try:
            checked = msgspec.convert(value, type=typ)
            if isinstance(checked, float) and not math.isfinite(checked):
                raise msgspec.ValidationError(f"Expected a finite number, got {value!r}")
        except msgspec.ValidationError as e:
            warnings.append(f"{where}: field {key!r} ignored: {e}")
            continue
        out[key] = checked
    return out, warnings


@dataclass
class HostRun:
    """One runner's subdirectory and its ``run.json``."""

    dir: str
    record: dict[str, Any]
    #: Fields of a ``run.json`` read back that were dropped for their type.
    warnings: list[str] = field(default_factory=list)

    @property
    def host(self) -> str:
        return str(self.record.get("host", "?"))

    @property
    def job_id(self) -> str | None:
        v = self.record.get("job_id")
        return None if v is None else str(v)

    @property
    def started(self) -> float:
        return float(self.record.get("started_at", 0.0))

    @property
    def ended(self) -> float | None:
        v = self.record.get("ended_at")
        return None if v is None else float(v)

    @property
    def attempt(self) -> int:
        v = self.record.get("attempt", 1)
        return v if isinstance(v, int) and not isinstance(v, bool) else 1

    def last_activity(self) -> float:
        times = [self.ended or self.started]
        for name in (*LOG_NAMES, RUN_FILE):
            with contextlib.suppress(OSError):
                times.append(os.path.getmtime(os.path.join(self.dir, name)))
        return max(times)

    def log_files(self) -> list[str]:
        return [p for p in (os.path.join(self.dir, n) for n in LOG_NAMES) if os.path.isfile(p)]


def job_id_from_env(env: Mapping[str, str]) -> str | None:
    for var in JOB_ID_VARS:
        if env.get(var):
            return f"{var}={env[var]}"
    return None


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def create(base: str, argv: list[str], job_id: str | None, attempt: int = 1) -> HostRun:
    """Make this run's subdirectory of ``base`` and its ``run.json``; LogDirError if impossible.
    ``attempt``: which run of the command this is (--max-restarts); each has its own subdirectory."""
    host = socket.gethostname()
    started = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    path = os.path.join(base, f"{stamp}_{host}_{os.getpid()}" + (f"_attempt{attempt}" if attempt > 1 else ""))
    record = {
        "host": host,
        "pid": os.getpid(),
        "command": argv,
        "job_id": job_id,
        "cwd": os.getcwd(),
        "started_at": started,
        "ended_at": None,
        "exit_status": None,
        "attempt": attempt,
    }
    try:
        os.makedirs(path, exist_ok=False)
        _write_json(os.path.join(path, RUN_FILE), record)
    except OSError as e:
        raise LogDirError(
            f"cannot write the log directory {base}: {e.strerror or e} (choose another with --logs DIR)"
        ) from e
    return HostRun(path, record)


def record_exit(run: HostRun, signum: int) -> None:
    """Write ``exit.log``: the child was ended by signal ``signum`` (seen by the runner, so also
    when the child printed nothing)."""
    with contextlib.suppress(OSError), open(os.path.join(run.dir, EXIT_LOG), "w", encoding="utf-8") as f:
        f.write(
            f"ckptguard run: the command {run.record.get('command', ['?'])[0]!s} exits with return code = {-signum}\n"
        )


def finish(run: HostRun, **fields: Any) -> None:
    """Record the end of the run (status, report paths) in its ``run.json``."""
    run.record.update(fields)
    with contextlib.suppress(OSError):
        _write_json(os.path.join(run.dir, RUN_FILE), run.record)


#: A run.json is a few hundred bytes; one handed to `diagnose` may come from anywhere.
MAX_RUN_FILE_BYTES = 1 << 20


def read(path: str) -> HostRun | None:
    """The run recorded in ``path``, or None where there is none or it is unreadable (never blocks on a
    FIFO, never recurses without bound: through the bounded JSON parser of control files)."""
    run_file = os.path.join(path, RUN_FILE)
    try:
        record = read_json(run_file, "run record", max_bytes=MAX_RUN_FILE_BYTES)
    except (OSError, CheckpointError):
        return None
    if not isinstance(record, dict):
        return None
    checked, warnings = typed_record(record, run_file)
    return HostRun(path, checked, warnings)


def host_runs(base: str) -> list[HostRun]:
    """Every runner subdirectory directly under ``base``, oldest first."""
    runs = []
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir(base)):
            r = read(os.path.join(base, entry))
            if r is not None:
                runs.append(r)
    return sorted(runs, key=lambda r: r.started)


def _same_job(a: HostRun, b: HostRun, now: float) -> bool:
    if a.attempt != b.attempt:  # each attempt of a restarted job is diagnosed on its own
        return False
    if a.job_id is not None and b.job_id is not None:
        return a.job_id == b.job_id
    a_end = (
        a.ended
        if a.ended is not None
        else max(now if now - a.last_activity() < STALE_S else a.last_activity(), a.started)
    )
    b_end = (
        b.ended
        if b.ended is not None
        else max(now if now - b.last_activity() < STALE_S else b.last_activity(), b.started)
    )
    return a.started <= b_end and b.started <= a_end


def job_of(me: HostRun, base: str) -> list[HostRun]:
    """``me`` and every other run under ``base`` of the same job."""
    now = time.time()
    return [r for r in host_runs(base) if r.dir == me.dir or _same_job(me, r, now)]


def wait_for_job(me: HostRun, base: str, grace_s: float) -> list[HostRun]:
    """The runs of ``me``'s job once each has recorded its end, or after ``grace_s`` seconds."""
    deadline = time.monotonic() + grace_s
    while True:
        runs = job_of(me, base)
        if all(r.ended is not None or r.dir == me.dir for r in runs) or time.monotonic() >= deadline:
            return runs
        time.sleep(0.2)


def runs_for_path(path: str) -> tuple[list[HostRun], str] | None:
    """The runs a `diagnose` path means, and a note saying which, or None if ``path`` is not a
    `ckptguard run` log directory. A host-run directory means its job; a directory of them means
    the job that started last."""
    if not os.path.isdir(path):
        return None
    me = read(path)
    if me is not None:
        runs = job_of(me, os.path.dirname(os.path.abspath(path)))
        return runs, f"the job of {os.path.basename(os.path.normpath(path))}: {len(runs)} host run(s)"
    runs = host_runs(path)
    if not runs:
        return None
    last = runs[-1]
    job = job_of(last, path)
    older = len(runs) - len(job)
    note = f"the job that started last in {path}: {len(job)} host run(s)"
    if older:
        note += f"; {older} older run(s) in the directory not read (name one of their directories to read it)"
    return job, note
