"""Running ``ckptguard run`` from a test: its command line, a clean environment, the reports it writes.

The job's environment drops the variables of an enclosing launcher or scheduler (a test run under
torchrun or Slurm would otherwise hand them to the job and to the runner's detection), and puts
``src/`` and the repository root on the job's ``PYTHONPATH`` so that workers import this checkout
and ``tests.support``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.support.jobs import REPO

#: ``ckptguard run`` in this interpreter.
RUN = [sys.executable, "-m", "ckptguard", "run"]

# What an enclosing launcher or scheduler would leak into the job (and into the runner's job id).
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "PBS_JOBID",
    "LSB_JOBID",
    "JOB_ID",
    "PET_RDZV_ID",
)


def run_env(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's variables, gloo on loopback, one OpenMP
    thread, unbuffered output; then ``extra``."""
    env = dict(os.environ)
    for k in _LAUNCHER_VARS:
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def read_reports(logs: Path) -> list[dict[str, Any]]:
    """Every ``report.json`` under the ``--logs`` directory ``logs``, in the order of their run directories."""
    return [json.loads(p.read_text()) for p in sorted(logs.glob("*/report.json"))]


def read_report(logs: Path) -> dict[str, Any]:
    """The one ``report.json`` under ``logs`` (fails the test where there is not exactly one)."""
    (only,) = read_reports(logs)
    return only


def torchrun(nnodes: int, node: int, port: int, *job: str) -> list[str]:
    """The command of node ``node`` of a ``nnodes`` x 2-rank torchrun job on 127.0.0.1 (static
    rendezvous, so global ranks follow the node rank), running ``job`` (a script and its arguments)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=2",
        "--rdzv-backend=static",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        f"--node-rank={node}",
        "--max-restarts=0",
        *job,
    ]
