"""`ckptguard run [OPTIONS] -- COMMAND ...`: any launcher, its output kept, its failure explained.

Exit status: the command's (128 + N when signal N ended it); 125 when the runner refuses before
starting it (bad option, unwritable --logs), 126 not executable, 127 command not found.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ckptguard.cli import app


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def run(
    command: Annotated[list[str], typer.Argument(help="The command and its arguments (after --).")],
    logs: Annotated[str, typer.Option(
        "--logs", help="Log directory (may be shared by all nodes); one subdirectory per host and run.")] = "ckptguard-logs",
    checkpoints: Annotated[str | None, typer.Option(
        "--checkpoints", help="Checkpoint root (path or s3://): on failure, name the step to resume from.")] = None,
    deep: Annotated[bool, typer.Option("--deep", help="With --checkpoints: checksum every byte.")] = False,
    on_failure: Annotated[str | None, typer.Option(
        "--on-failure", help="Shell command run once after a failure, with CKPTGUARD_REPORT_JSON etc. set.")] = None,
    grace: Annotated[float, typer.Option(
        "--grace", help="Seconds (0-10) to wait for other nodes' runs in the same --logs to end.")] = 10.0,
    job_id: Annotated[str | None, typer.Option(
        "--job-id", help="Which runs in --logs are one job (default: SLURM_JOB_ID etc., else overlap in time).")] = None,
    max_log_bytes: Annotated[int, typer.Option(
        "--max-log-bytes", min=1024, help="Cap per stream; the head and the tail are kept.")] = 256 << 20,
) -> None:
    """Run COMMAND (torchrun, deepspeed, accelerate launch, srun, mpirun, python ...) and explain its failure."""
    from ckptguard.runner import RunOptions
    from ckptguard.runner import run as run_job

    status = run_job(RunOptions(command=command, logs=logs, checkpoints=checkpoints, deep=deep,
                                on_failure=on_failure, grace_s=grace, job_id=job_id, max_log_bytes=max_log_bytes))
    raise typer.Exit(status)
