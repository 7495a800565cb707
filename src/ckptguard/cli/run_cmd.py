"""`ckptguard run [OPTIONS] -- COMMAND ...`: any launcher, its output kept, its failure explained.

Exit status: the command's (128 + N when signal N ended it); 125 when the runner refuses before
starting it (bad option, unwritable --logs), 126 not executable, 127 command not found.

The options are parsed by argparse, before typer runs (`ckptguard.cli.main` hands ``run`` over
here): typer's parsing costs seconds on a loaded node, which every node of a job would pay at
start. The typer command only lists `run` in `ckptguard --help` and forwards to the same parser.
"""

from __future__ import annotations

import argparse
import sys

import typer

from ckptguard.cli import app

RUNNER_ERROR = 125


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptguard run",
        usage="ckptguard run [OPTIONS] -- COMMAND [ARGS ...]",
        description="Run COMMAND (torchrun, deepspeed, accelerate launch, srun, mpirun, python ...): its output "
        "passed through and kept; on failure, the whole job's diagnosis and the step to resume from.",
    )
    p.add_argument(
        "--logs",
        default="ckptguard-logs",
        help="log directory (may be shared by all nodes); one subdirectory per host and run (default: %(default)s)",
    )
    p.add_argument(
        "--checkpoints", metavar="ROOT", help="checkpoint root (path or s3://): name the step to resume from"
    )
    p.add_argument("--deep", action="store_true", help="with --checkpoints: checksum every byte")
    p.add_argument(
        "--on-failure",
        metavar="CMD",
        help="shell command run once after a failure, with CKPTGUARD_REPORT_JSON etc. set",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds (0-10) to wait for the other nodes' runs in --logs to end (default: 10)",
    )
    p.add_argument(
        "--job-id", help="which runs in --logs are one job (default: SLURM_JOB_ID etc., else overlap in time)"
    )
    p.add_argument(
        "--max-log-bytes",
        type=int,
        default=256 << 20,
        help="cap per stream; the head and the tail are kept (default: 256 MiB)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        metavar="SECONDS",
        help="no output and no heartbeat from the job for this long is a hang: capture every rank's "
        "stack, name the rank that stopped, stop the job (default: off)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="with --checkpoints: restart the command up to N times after a transient failure "
        "(network, rendezvous, lost process, preemption, hang), never after a deterministic one",
    )
    p.add_argument(
        "--restart-on",
        metavar="CLASS,...",
        default="",
        help="failure classes to treat as transient as well (see `ckptguard explain`)",
    )
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="wait before the first restart, doubled for each next one (default: 2)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments, after --")
    return p


def main(argv: list[str]) -> int:
    """Parse ``argv`` (what follows ``run``) and run the command; the status to exit with."""
    parser = _parser()
    if "--" in argv:
        i = argv.index("--")
        try:
            ns = parser.parse_args(argv[:i])
        except SystemExit as e:
            return 0 if e.code == 0 else RUNNER_ERROR
        ns.command = argv[i + 1 :]
    else:
        try:
            ns = parser.parse_args(argv)
        except SystemExit as e:
            return 0 if e.code == 0 else RUNNER_ERROR
    if not ns.command:
        parser.print_usage(sys.stderr)
        sys.stderr.write("ckptguard run: no command given\n")
        return RUNNER_ERROR
    if ns.max_log_bytes < 1024:
        sys.stderr.write("ckptguard run: --max-log-bytes must be at least 1024\n")
        return RUNNER_ERROR
    from ckptguard.runner import RunOptions, run

    return run(
        RunOptions(
            command=ns.command,
            logs=ns.logs,
            checkpoints=ns.checkpoints,
            deep=ns.deep,
            on_failure=ns.on_failure,
            grace_s=ns.grace,
            job_id=ns.job_id,
            max_log_bytes=ns.max_log_bytes,
            hang_timeout_s=ns.hang_timeout,
            max_restarts=ns.max_restarts,
            backoff_s=ns.restart_backoff,
            restart_on=tuple(c.strip() for c in ns.restart_on.split(",") if c.strip()),
        )
    )


@app.command(
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": [],
    }
)
def run(ctx: typer.Context) -> None:
    """Run a launcher command; on failure: the whole job's diagnosis and the step to resume from
    (`ckptguard run --help` for the options)."""
    raise typer.Exit(main(list(ctx.args)))
