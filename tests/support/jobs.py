"""Launch real torchrun jobs from pytest: one agent per simulated node, all on 127.0.0.1.

Why this exists: the races ckptguard prevents only show up with several real processes
(and several *agents*, i.e. several "nodes", each with its own LOCAL_RANK 0). A test
must be able to start such a job, get every rank's output back, and never leave a
worker behind, whatever happens.

How it works:

* ``--rdzv-backend=static --master-addr=127.0.0.1 --master-port=P --node-rank=i`` so
  global ranks are fixed: node ``i`` holds ranks ``i*nproc .. i*nproc+nproc-1``.
  (The c10d backend ignores ``--node-rank``; the join order would decide.)
* ``--tee 3 --log-dir <tmp>``: every worker's stdout and stderr go to per-rank files
  *and* to the agent's console. The console copy is prefixed by torchrun's tail thread
  with ``[rank<global rank>]:`` (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``; torchrun's own
  default, ``[default<local rank>]:``, is ambiguous across nodes). The per-rank files are
  read back after exit into :attr:`AgentResult.worker_logs`: they are complete even if
  the tail thread missed the last lines of a dying worker, so assertions about one
  rank's traceback should use :meth:`JobResult.rank_output`.
* torchrun starts every worker in a *new session* (its own process group), so killing
  the agent's group does not reach them. Every process of a job therefore carries an
  environment marker (``CKPTGUARD_BED_JOB=<uuid>``); on timeout, on any exception, and
  after every job, all processes carrying the marker are killed (their groups too).
* The repository root is prepended to the workers' ``PYTHONPATH``, so a worker script can
  ``from tests.support.results import emit_result`` wherever it lives.
* ``agent=False`` (the default) starts the workers without torchrun's agent, with the environment
  torchrun gives them (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``TORCHELASTIC_*``, ...; rank 0
  hosts the store instead of the agent) and the agent's failure policy: once a worker of a node
  exits non-zero, that node's other workers get SIGTERM, then SIGKILL after
  :data:`SHUTDOWN_GRACE`, and the node "exits" 1. Each worker's stdout and stderr go to per-rank
  files that are read back the same way, and the node's console output is rebuilt from them with
  the same ``[default<rank>]:`` prefix. An agent costs every job one more ``import torch`` and
  its rendezvous (seconds on two cores); the tests of torchrun itself and of what its agent
  prints pass ``agent=True``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

#: Environment variable that tags every process of one job (agents and workers).
JOB_MARKER = "CKPTGUARD_BED_JOB"

#: The repository root (``tests/support/jobs.py`` -> ``.``): workers import ``tests.support`` from it.
REPO = Path(__file__).resolve().parents[2]

#: How long the workers of a node get after SIGTERM once a sibling failed (torchrun's shutdown timeout).
SHUTDOWN_GRACE = 30.0

#: Console prefix of worker lines: global rank, like c10d's own ``[rankN]:``.
DEFAULT_PREFIX_TEMPLATE = "[default${rank}]:"

# Variables of an enclosing torchrun/elastic job that must not leak into ours.
_INHERITED_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)

# How torchrun's agent reports a worker that died by SIGKILL (its ChildFailedError table).
_AGENT_SAW_SIGKILL = re.compile(r"exitcode\s*:\s*-9|Signal 9 \(SIGKILL\)")

_ADDR_IN_USE = ("EADDRINUSE", "Address already in use", "address already in use")


@dataclass
class AgentResult:
    """One torchrun agent (one simulated node) and what its workers printed."""

    node_rank: int
    returncode: int
    output: str
    """Combined stdout+stderr of the agent, including the tee'd, prefixed worker lines."""
    worker_logs: dict[int, str] = field(default_factory=dict)
    """Global rank -> that worker's stdout followed by its stderr, from torchrun's log files."""
    exit_codes: dict[int, int] = field(default_factory=dict)
    """Global rank -> its exit status (negative: the signal), where the launcher saw it (no agent)."""


@dataclass
class JobResult:
    """All agents of one job."""

    agents: list[AgentResult]
    attempts: int = 1
    """How many rendezvous ports were tried (>1 after a port clash)."""

    @property
    def ok(self) -> bool:
        """True when every agent exited 0 (torchrun exits non-zero if any worker failed)."""
        return bool(self.agents) and all(a.returncode == 0 for a in self.agents)

    def output(self) -> str:
        """All agents' console output, one block per node, for assertion messages."""
        return "\n".join(
            f"===== node {a.node_rank} (torchrun rc={a.returncode}) =====\n{a.output}" for a in self.agents
        )

    def sigkilled(self) -> bool:
        """Did a worker die by SIGKILL? From the exit statuses, or from the agent's failure report."""
        return any(code == -signal.SIGKILL for a in self.agents for code in a.exit_codes.values()) or bool(
            _AGENT_SAW_SIGKILL.search(self.output())
        )

    def rank_output(self, rank: int) -> str:
        """The complete stdout+stderr of one global rank ('' if it never started)."""
        for a in self.agents:
            if rank in a.worker_logs:
                return a.worker_logs[rank]
        return ""

    def ranks_with_traceback(self) -> list[int]:
        """Global ranks whose log contains a Python traceback, in rank order."""
        return sorted(r for a in self.agents for r, log in a.worker_logs.items() if "Traceback" in log)


class JobTimeout(TimeoutError):
    """The job ran past its timeout; every process of it has been killed."""

    def __init__(self, timeout: float, result: JobResult) -> None:
        super().__init__(f"torchrun job timed out after {timeout:.0f} s\n{result.output()}")
        self.result = result


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (``T`` stopped, ``Z`` a zombie, ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (run_job retries if it was taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pids_with_marker(marker: str) -> list[int]:
    """Every live process whose environment carries ``JOB_MARKER=marker`` (Linux /proc)."""
    needle = f"{JOB_MARKER}={marker}".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or a kernel thread
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def _kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (and ``pid`` itself), never our own group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        pgid = os.getpgid(pid)
        if pgid != os.getpgrp():
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def kill_job(marker: str, agents: Sequence[subprocess.Popen[bytes]] = ()) -> None:
    """Kill every process of a job: the agents' groups, then anything carrying the marker."""
    for p in agents:
        if p.poll() is None:
            _kill_group(p.pid)
    for p in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    # Workers live in their own sessions; a few rounds catch anything forked meanwhile.
    for _ in range(5):
        pids = _pids_with_marker(marker)
        if not pids:
            return
        for pid in pids:
            _kill_group(pid)
        time.sleep(0.1)


def _read_worker_logs(log_dir: Path, node_rank: int, nproc_per_node: int) -> dict[int, str]:
    """Collect ``<log_dir>/<run_id>_*/attempt_*/<local_rank>/std{out,err}.log`` by global rank."""
    logs: dict[int, str] = {}
    for rank_dir in sorted(log_dir.glob("*/attempt_*/*")):
        if not rank_dir.is_dir() or not rank_dir.name.isdigit():
            continue
        rank = node_rank * nproc_per_node + int(rank_dir.name)
        parts = []
        for name in ("stdout.log", "stderr.log"):
            f = rank_dir / name
            if f.exists():
                parts.append(f.read_text(errors="replace"))
        logs[rank] = logs.get(rank, "") + "".join(parts)
    return logs


def _build_env(base: Mapping[str, str] | None, extra: Mapping[str, str] | None, marker: str) -> dict[str, str]:
    env = dict(os.environ)
    for k in _INHERITED_DIST_VARS:
        env.pop(k, None)
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=DEFAULT_PREFIX_TEMPLATE,
    )
    env.update(base or {})
    env.update(extra or {})
    env.pop("TORCHELASTIC_ERROR_FILE", None)  # else workers' error.json overwrite each other
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env[JOB_MARKER] = marker
    return env


def _port_clash(text: str) -> bool:
    return any(s in text for s in _ADDR_IN_USE)


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], tmpdir: Path, timeout: float, grace: float) -> bool:
    """Wait for every agent; True if the job timed out.

    Once one agent has failed, the others get ``grace`` seconds and are then killed
    (normally they die by themselves when their workers' collectives fail, but an agent
    still waiting for a rendezvous that its failed peer hosted would wait forever). If
    the failure was the rendezvous port being taken, the others are killed at once.
    """
    deadline = time.monotonic() + timeout
    stop_at = deadline
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False
        now = time.monotonic()
        if now >= stop_at:
            return now >= deadline
        for node, c in enumerate(codes):
            if c not in (None, 0):
                out = (tmpdir / f"agent{node}.out").read_text(errors="replace")
                stop_at = min(stop_at, now if _port_clash(out) else now + grace)
        time.sleep(0.05)


def _run_once(
    script: Path,
    args: Sequence[str],
    nnodes: int,
    nproc_per_node: int,
    env: Mapping[str, str] | None,
    node_env: Sequence[Mapping[str, str]] | None,
    timeout: float,
    cwd: Path | None,
    port: int,
    straggler_grace: float,
) -> JobResult:
    marker = uuid.uuid4().hex
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="ckptguard-job-") as tmp:
        tmpdir = Path(tmp)
        outs = []
        try:
            for node in range(nnodes):
                log_dir = tmpdir / f"node{node}"
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    f"--nnodes={nnodes}",
                    f"--nproc-per-node={nproc_per_node}",
                    "--rdzv-backend=static",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                    f"--node-rank={node}",
                    "--max-restarts=0",
                    "--tee=3",
                    f"--log-dir={log_dir}",
                    str(script),
                    *map(str, args),
                ]
                out = open(tmpdir / f"agent{node}.out", "wb")  # noqa: SIM115 - closed below
                outs.append(out)
                extra = node_env[node] if node_env is not None else None
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=_build_env(env, extra, marker),
                        cwd=cwd,
                        start_new_session=True,
                    )
                )
            timed_out = _wait_all(procs, tmpdir, timeout, straggler_grace)
        finally:
            # Kills everything on timeout / KeyboardInterrupt / any error, and reaps
            # stray workers after a normal exit (a no-op when all have exited).
            kill_job(marker, procs)
            for out in outs:
                out.close()
        agents = []
        for node, p in enumerate(procs):
            agents.append(
                AgentResult(
                    node_rank=node,
                    returncode=p.returncode if p.returncode is not None else -signal.SIGKILL,
                    output=(tmpdir / f"agent{node}.out").read_text(errors="replace"),
                    worker_logs=_read_worker_logs(tmpdir / f"node{node}", node, nproc_per_node),
                )
            )
        result = JobResult(agents)
        if timed_out:
            raise JobTimeout(timeout, result)
        return result


def _worker_env(
    base: dict[str, str], node: int, local_rank: int, nnodes: int, nproc_per_node: int, port: int
) -> dict[str, str]:
    """What torchrun's agent puts in a worker's environment (rank 0 hosts the store instead of it)."""
    rank = node * nproc_per_node + local_rank
    world = nnodes * nproc_per_node
    return {
        **base,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(node),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _signal_node(workers: Mapping[int, tuple[int, subprocess.Popen[bytes]]], node: int, sig: int) -> None:
    """Send ``sig`` to the live workers of ``node`` (each leads its own session: its group is its pid)."""
    for worker_node, proc in workers.values():
        if worker_node == node and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)


def _start_worker(
    argv: Sequence[str], env: Mapping[str, str], stdout: IO[bytes], stderr: IO[bytes], cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """``python -u <argv>`` in a session of its own, as torchrun starts a worker."""
    return subprocess.Popen(
        [sys.executable, "-u", *map(str, argv)],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
    )


def _rank_dir(tmpdir: Path, node: int, local_rank: int) -> Path:
    """Where a worker's stdout.log and stderr.log go: the layout of torchrun's --log-dir, which
    :func:`_read_worker_logs` reads."""
    return tmpdir / f"node{node}" / "direct" / "attempt_0" / str(local_rank)


def _console(logs: Mapping[int, str], codes: Mapping[int, int | None]) -> str:
    """A node's console as torchrun's tee would show it, from its workers' logs (rank -> text): each
    worker's lines under ``[default<rank>]:``, then one line per worker that did not exit 0."""
    lines = []
    for rank, text in sorted(logs.items()):
        lines.extend(f"[default{rank}]:{line}" for line in text.splitlines())
    for rank, code in sorted(codes.items()):
        if code != 0:
            lines.append(f"worker rank {rank} exited with code {code}")
    return "\n".join(lines) + "\n"


def _supervise(
    workers: Mapping[int, tuple[int, subprocess.Popen[bytes]]],
    timeout: float,
    straggler_grace: float,
    port_clash: Callable[[int], bool],
) -> tuple[bool, set[int]]:
    """Wait for the workers (rank -> (node, process)) under torchrun's failure policy; returns whether
    the job timed out and the nodes whose workers were still running when it was stopped.

    Once a worker of a node exits non-zero, the node's other workers get SIGTERM, then SIGKILL after
    :data:`SHUTDOWN_GRACE`; the other nodes get ``straggler_grace`` seconds (none when the failed
    worker could not bind the store's port: the others would wait for a store that never comes up)."""
    deadline = time.monotonic() + timeout
    stop_at = deadline
    terminated: dict[int, float] = {}  # node -> when its workers got SIGTERM
    while True:
        now = time.monotonic()
        codes = {rank: p.poll() for rank, (_, p) in workers.items()}
        if all(c is not None for c in codes.values()):
            return False, set()
        if now >= stop_at:
            return now >= deadline, {node for rank, (node, _) in workers.items() if codes[rank] is None}
        for rank, (node, _proc) in workers.items():
            if codes[rank] not in (None, 0) and node not in terminated:
                terminated[node] = now
                stop_at = min(stop_at, now if port_clash(rank) else now + straggler_grace)
                _signal_node(workers, node, signal.SIGTERM)
        for node, since in terminated.items():
            if now - since > SHUTDOWN_GRACE:
                _signal_node(workers, node, signal.SIGKILL)
        time.sleep(0.05)


def run_workers(
    argv: Sequence[str], *, nproc: int = 2, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node=nproc <argv>`` without the agent: ``nproc`` workers of
    ``python -u <argv>`` in torchrun's environment and under its failure policy, their output in one
    stdout and one stderr as torchrun without ``--tee`` leaves it (the workers inherit its streams).

    Returns the workers' stdout and stderr and 0 when every worker exited 0, else 1 (torchrun's
    status). Raises ``subprocess.TimeoutExpired`` (after killing every worker) past ``timeout``."""
    marker = uuid.uuid4().hex
    workers: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}
    port = free_port()
    base = _build_env(env, None, marker)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            for rank in range(nproc):
                workers[rank] = (0, _start_worker(argv, _worker_env(base, 0, rank, 1, nproc, port), out, err))
            timed_out, _ = _supervise(workers, timeout, timeout, lambda rank: False)
        finally:
            kill_job(marker, [p for _, p in workers.values()])
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    code = 0 if all(p.returncode == 0 for _, p in workers.values()) else 1
    return subprocess.CompletedProcess(list(argv), code, stdout, stderr)


def _run_direct(
    script: Path,
    args: Sequence[str],
    nnodes: int,
    nproc_per_node: int,
    env: Mapping[str, str] | None,
    node_env: Sequence[Mapping[str, str]] | None,
    timeout: float,
    cwd: Path | None,
    port: int,
    straggler_grace: float,
) -> JobResult:
    """The job without agents: the workers themselves, under torchrun's environment and failure policy."""
    marker = uuid.uuid4().hex
    workers: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}  # rank -> (node, process)
    with tempfile.TemporaryDirectory(prefix="ckptguard-job-") as tmp:
        tmpdir = Path(tmp)
        timed_out = False
        node_killed: set[int] = set()

        def err_log(rank: int) -> str:
            return (_rank_dir(tmpdir, *divmod(rank, nproc_per_node)) / "stderr.log").read_text(errors="replace")

        try:
            for node in range(nnodes):
                base = _build_env(env, node_env[node] if node_env is not None else None, marker)
                for local in range(nproc_per_node):
                    rank_dir = _rank_dir(tmpdir, node, local)
                    rank_dir.mkdir(parents=True)
                    with open(rank_dir / "stdout.log", "wb") as out, open(rank_dir / "stderr.log", "wb") as err:
                        worker_env = _worker_env(base, node, local, nnodes, nproc_per_node, port)
                        proc = _start_worker([str(script), *args], worker_env, out, err, cwd)
                    workers[node * nproc_per_node + local] = (node, proc)
            timed_out, node_killed = _supervise(
                workers, timeout, straggler_grace, lambda rank: _port_clash(err_log(rank))
            )
        finally:
            kill_job(marker, [p for _, p in workers.values()])
        agents = []
        for node in range(nnodes):
            codes = {rank: p.returncode for rank, (n, p) in workers.items() if n == node}
            if node in node_killed:
                returncode = -signal.SIGKILL
            else:
                returncode = 0 if codes and all(c == 0 for c in codes.values()) else 1
            logs = _read_worker_logs(tmpdir / f"node{node}", node, nproc_per_node)
            agents.append(
                AgentResult(
                    node_rank=node,
                    returncode=returncode,
                    output=_console(logs, codes),
                    worker_logs=logs,
                    exit_codes={rank: code for rank, code in codes.items() if code is not None},
                )
            )
        result = JobResult(agents)
        if timed_out:
            raise JobTimeout(timeout, result)
        return result


def run_job(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    nnodes: int = 1,
    nproc_per_node: int = 2,
    env: Mapping[str, str] | None = None,
    node_env: Sequence[Mapping[str, str]] | None = None,
    timeout: float = 180,
    cwd: Path | None = None,
    port_retries: int = 2,
    straggler_grace: float = 60,
    agent: bool = False,
) -> JobResult:
    """Run ``script`` as a torchrun job of ``nnodes`` agents x ``nproc_per_node`` workers.

    With ``agent=False`` (the default) the workers start without torchrun's agents, in the
    environment and under the failure policy torchrun gives them (the module docstring).

    ``env`` goes to every node, ``node_env[i]`` only to node ``i`` (e.g. a private
    checkpoint root per node). Returns when all agents exited; raises :class:`JobTimeout`
    (after killing everything) if that takes longer than ``timeout`` seconds. Once an
    agent has failed, the others get ``straggler_grace`` seconds before they are killed
    (their returncode is then -9). If the rendezvous port was taken between
    :func:`free_port` and bind, retries with a new port up to ``port_retries`` times.
    """
    if node_env is not None and len(node_env) != nnodes:
        raise ValueError(f"node_env has {len(node_env)} entries for {nnodes} nodes")
    script = Path(script).resolve()
    launch = _run_once if agent else _run_direct
    for attempt in range(port_retries + 1):
        result = launch(
            script,
            args,
            nnodes,
            nproc_per_node,
            env,
            node_env,
            timeout,
            cwd,
            free_port(),
            straggler_grace,
        )
        port_clash = not result.ok and any(_port_clash(a.output) for a in result.agents)
        if not port_clash or attempt == port_retries:
            result.attempts = attempt + 1
            return result
    raise AssertionError("unreachable")


def run_local(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 180,
    cwd: Path | None = None,
) -> JobResult:
    """A single-node job: ``run_job(script, args, nnodes=1, nproc_per_node=nproc)``."""
    return run_job(script, args, nnodes=1, nproc_per_node=nproc, env=env, timeout=timeout, cwd=cwd)
