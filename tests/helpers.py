"""Shared helpers for tests that run real torchrun jobs."""

from __future__ import annotations

import json
import re
from pathlib import Path

from beds.jobs import JobResult, run_job

WORKERS = Path(__file__).parent / "workers"
CKPT_JOB = WORKERS / "ckpt_job.py"

_RESULT = re.compile(r"RESULT (\{.*\})")


def results(job: JobResult) -> list[dict]:
    """Every RESULT line the workers printed, parsed (each rank's complete log, not the console tail)."""
    out = []
    for agent in job.agents:
        for log in agent.worker_logs.values():
            out.extend(json.loads(m.group(1)) for m in _RESULT.finditer(log))
    return out


def by_rank(job: JobResult, key: str) -> dict[int, object]:
    return {r["rank"]: r[key] for r in results(job) if key in r}


def ckpt_job(scenario: str, *args: str, nnodes: int = 1, nproc: int = 2, env: dict | None = None,
             node_env: list[dict] | None = None, timeout: float = 180, check: bool = True) -> JobResult:
    job = run_job(CKPT_JOB, [scenario, *args], nnodes=nnodes, nproc_per_node=nproc, env=env,
                  node_env=node_env, timeout=timeout)
    if check:
        assert job.ok, job.output()
    return job
