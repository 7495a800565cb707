"""The worker scripts tests run as torchrun jobs, and a shortcut for the checkpoint worker."""

from __future__ import annotations

from pathlib import Path

from .jobs import JobResult, run_job

TESTS = Path(__file__).resolve().parent.parent
WORKERS = TESTS / "workers"
CKPT_JOB = WORKERS / "ckpt_job.py"  # Checkpointer / save_file scenarios (tests/api/test_distributed.py)
CAMPAIGN_JOB = WORKERS / "campaign_job.py"  # the crash-consistency campaign's worker
PROBE = Path(__file__).resolve().parent / "beds" / "workers" / "probe.py"  # checks the launcher itself
BASELINES = TESTS / "baselines"  # the known-racy protocols the beds must break


def ckpt_job(
    scenario: str,
    *args: str,
    nnodes: int = 1,
    nproc: int = 2,
    env: dict | None = None,
    node_env: list[dict] | None = None,
    timeout: float = 180,
    check: bool = True,
) -> JobResult:
    """Run one scenario of ``tests/workers/ckpt_job.py``; by default, fail unless every rank exited 0."""
    job = run_job(
        CKPT_JOB, [scenario, *args], nnodes=nnodes, nproc_per_node=nproc, env=env, node_env=node_env, timeout=timeout
    )
    if check:
        assert job.ok, job.output()
    return job
