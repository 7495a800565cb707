"""`ckptguard run`: run any launcher command, pass its output through, keep it, and explain a failure.

The pieces: ``child`` (spawn, pass-through over pipes or pseudo-terminals, signal forwarding),
``capture`` (the kept bytes, head and tail, arrival times), ``logdir`` (one subdirectory per host
and run, finding a job's other hosts), ``report`` (the whole-job diagnosis and resume section),
``hang`` (--hang-timeout: stacks of every rank, the rank that stopped), ``restart``
(--max-restarts: which failures are worth another attempt). ``heartbeat`` (the job's progress
signal) lives in ``ckptguard.heartbeat``, below the Checkpointer that sends it.
The exit status is always the child's (the last attempt's); the runner's own refusals happen before the child starts
(125: options or log directory, 126: not executable, 127: command not found).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

from ckptguard.heartbeat import heartbeat as heartbeat
from ckptguard.runner import logdir
from ckptguard.runner.capture import DEFAULT_CAP, StreamCapture
from ckptguard.runner.child import FORWARDED, CommandNotFound, run_child, wait_in_steps

if TYPE_CHECKING:
    from ckptguard.diagnose.model import Diagnosis

RUNNER_ERROR = 125
#: After a hang: how long the stopped job gets between SIGTERM and SIGKILL (at most --grace).
HANG_KILL_GRACE_S = 5.0
MAX_GRACE_S = 10.0
#: Where torchrun's agent writes the root-cause worker's error file (entry points decorated
#: with ``@record``); set only when the user has not set it.
ERROR_FILE = "torchelastic_error.json"


@dataclass
class RunOptions:
    command: Sequence[str]
    logs: str = "ckptguard-logs"
    checkpoints: str | None = None
    deep: bool = False
    on_failure: str | None = None
    grace_s: float = MAX_GRACE_S
    job_id: str | None = None
    max_log_bytes: int = DEFAULT_CAP
    hang_timeout_s: float | None = None
    max_restarts: int = 0
    restart_on: tuple[str, ...] = ()
    backoff_s: float = 2.0


@dataclass
class Attempt:
    """One run of the command, for the restart policy and the report."""

    number: int
    dir: str
    status: int
    resumed_from: int | None
    reached: int | None = None
    failure: str | None = None
    decision: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "attempt": self.number,
            "dir": self.dir,
            "exit_status": self.status,
            "resumed_from": self.resumed_from,
            "reached": self.reached,
            "failure": self.failure,
            "decision": self.decision,
        }


def _say(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def child_env(base: Mapping[str, str], run: logdir.HostRun) -> dict[str, str]:
    """The child's environment: ours, plus where torchrun's agent may record the root cause."""
    env = dict(base)
    env.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(run.dir, ERROR_FILE))
    env["CKPTGUARD_RUN_LOGS"] = run.dir
    return env


def run(opts: RunOptions, env: Mapping[str, str] | None = None) -> int:
    """Run ``opts.command``; return the status `ckptguard run` exits with (the child's)."""
    env = dict(os.environ if env is None else env)
    if not opts.command:
        _say("ckptguard run: no command given (ckptguard run [OPTIONS] -- COMMAND ...)\n")
        return RUNNER_ERROR
    if not 0 <= opts.grace_s <= MAX_GRACE_S:
        _say(f"ckptguard run: --grace must be between 0 and {MAX_GRACE_S:.0f} seconds\n")
        return RUNNER_ERROR
    if not opts.logs:
        _say("ckptguard run: --logs must name a directory (it is empty)\n")
        return RUNNER_ERROR
    if opts.hang_timeout_s is not None and not opts.hang_timeout_s > 0:
        _say("ckptguard run: --hang-timeout must be a positive number of seconds\n")
        return RUNNER_ERROR
    if opts.max_restarts < 0:
        _say("ckptguard run: --max-restarts must be 0 or more\n")
        return RUNNER_ERROR
    if not 0 <= opts.backoff_s < float("inf"):  # NaN fails too
        _say("ckptguard run: --restart-backoff must be 0 or more seconds\n")
        return RUNNER_ERROR
    if opts.max_restarts and opts.checkpoints is None:
        _say("ckptguard run: --max-restarts needs --checkpoints ROOT (a restart resumes from its committed step)\n")
        return RUNNER_ERROR
    if opts.restart_on:
        from ckptguard.diagnose.kb import load_kb

        unknown = [c for c in opts.restart_on if c not in load_kb()]
        if unknown:
            _say(
                f"ckptguard run: --restart-on: unknown failure class(es) {', '.join(unknown)} "
                f"(`ckptguard explain` lists them)\n"
            )
            return RUNNER_ERROR
    job_id = opts.job_id or logdir.job_id_from_env(env)
    opts.logs = os.path.abspath(opts.logs)
    attempts: list[Attempt] = []
    while True:
        resumed_from = _committed_step(opts) if opts.max_restarts else None
        try:
            me = logdir.create(opts.logs, list(opts.command), job_id, attempt=len(attempts) + 1)
            out = StreamCapture(me.dir, "stdout", opts.max_log_bytes)
            err = StreamCapture(me.dir, "stderr", opts.max_log_bytes)
        except (logdir.LogDirError, OSError) as e:
            _say(f"ckptguard run: {e}\n")
            return RUNNER_ERROR if not attempts else attempts[-1].status
        # Installed before the child starts, so that no signal after its exit finds the default
        # handler (which would end the runner with a status that is not the child's).
        with _signals_end_early() as hook:
            status, diag, stop = _run_and_explain(opts, env, me, out, err, hook, attempts, resumed_from)
        attempt = attempts[-1]
        if status == 0 or not opts.max_restarts:
            break
        if stop:  # stopped from outside (a forwarded signal) or the command not found: no restart
            attempt.reached = _committed_step(opts)
            attempt.decision = stop
            _record_attempts(me, attempts)
            _say(f"ckptguard run: not restarted: {attempt.decision}\n")
            break
        from ckptguard.runner import restart

        attempt.reached = _committed_step(opts)
        again, why = restart.decide(diag, attempts, opts.restart_on, len(attempts) <= opts.max_restarts)
        again, why = restart.agree(opts.logs, job_id, len(attempts), again, why, opts.grace_s)
        attempt.decision = why
        _record_attempts(me, attempts)
        if not again:
            _say(f"ckptguard run: not restarted: {why}\n")
            break
        wait = min(opts.backoff_s * 2 ** (len(attempts) - 1), restart.MAX_BACKOFF_S)
        _say(
            f"ckptguard run: restarting (attempt {len(attempts) + 1} of at most {opts.max_restarts + 1}) in "
            f"{wait:g} s: {why}\n"
        )
        if _sleep_unless_signalled(wait):
            break
    if len(attempts) > 1 or opts.max_restarts:
        if attempts[-1].reached is None and opts.max_restarts:
            attempts[-1].reached = _committed_step(opts)
        _record_attempts(me, attempts)
        if len(attempts) > 1:
            _say("ckptguard run: attempts:\n" + "".join(f"  {_attempt_line(a)}\n" for a in attempts))
    return attempts[-1].status


def _committed_step(opts: RunOptions) -> int | None:
    if opts.checkpoints is None:
        return None
    try:
        from ckptguard.resume import resume_info

        return resume_info(opts.checkpoints).step
    except Exception:  # no answer is an answer: the attempt started from scratch
        return None


def _attempt_line(a: Attempt) -> str:
    start = "from scratch" if a.resumed_from is None else f"from step {a.resumed_from}"
    reached = "no step committed" if a.reached is None else f"reached step {a.reached}"
    end = "succeeded" if a.status == 0 else f"exit status {a.status}" + (f", {a.failure}" if a.failure else "")
    return f"#{a.number}: started {start}, {reached}, {end}" + (f"; {a.decision}" if a.decision else "")


def _record_attempts(me: logdir.HostRun, attempts: list[Attempt]) -> None:
    logdir.finish(me, attempts=[a.to_json() for a in attempts])


def _sleep_unless_signalled(seconds: float) -> bool:
    """Wait ``seconds`` before a restart; True when a signal (Ctrl-C, the scheduler's SIGTERM) came
    meanwhile: then there is no restart."""
    got: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        got.append(signum)

    previous = {s: signal.signal(s, handler) for s in FORWARDED}
    try:
        end = time.monotonic() + seconds
        while not got and time.monotonic() < end:
            time.sleep(min(0.1, max(end - time.monotonic(), 0)))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if got:
        _say(f"ckptguard run: signal {got[0]} received: no restart\n")
    return bool(got)


def _run_and_explain(
    opts: RunOptions,
    env: Mapping[str, str],
    me: logdir.HostRun,
    out: StreamCapture,
    err: StreamCapture,
    hook: _Hook,
    attempts: list[Attempt],
    resumed_from: int | None,
) -> tuple[int, Diagnosis | None, str]:
    """Run one attempt and explain its failure: its status, its diagnosis (None when it succeeded
    or none was made), and why the runner must stop there, or "" (a signal from outside, the command
    not found, a pipeline's reader gone)."""
    attempt = Attempt(len(attempts) + 1, me.dir, RUNNER_ERROR, resumed_from)
    attempts.append(attempt)
    watch = None
    cenv = child_env(env, me)
    if opts.hang_timeout_s is not None:
        from ckptguard.runner import hang

        cenv = hang.child_env(cenv, me.dir)
        watch = hang.HangWatch(
            opts.hang_timeout_s,
            me.dir,
            opts.checkpoints,
            min(opts.grace_s, HANG_KILL_GRACE_S),
            token=cenv[hang.TOKEN_VAR],
        )
    try:
        result = run_child(opts.command, cenv, out, err, watch=watch)
    except CommandNotFound as e:
        out.close()
        err.close()
        logdir.finish(me, ended_at=me.started, exit_status=e.status, error=str(e))
        _say(f"ckptguard run: {e}\n")
        attempt.status = e.status
        return e.status, None, "the command could not be started"
    if watch is not None and watch.fired_at is not None:
        if result.status == 0:  # a launcher that exits 0 on SIGTERM: a hang is still a failure
            result.status = 128 + signal.SIGTERM
        logdir.finish(me, hang_detected_at=watch.fired_at, hang_timeout_s=opts.hang_timeout_s)
    attempt.status = result.status
    out.close()
    err.close()
    logdir.finish(me, ended_at=result.ended_at, exit_status=result.status, signals_forwarded=result.signals_forwarded)
    if result.signal is not None:
        logdir.record_exit(me, result.signal)
    for cap in (out, err):
        if cap.failure is not None:
            _say(f"ckptguard run: {cap.failure} (in {me.dir}); the output was passed through whole\n")
    # Killed by SIGPIPE after our reader left (`ckptguard run ... | head`): how such a pipeline
    # ends, not a failure to explain.
    piped_away = result.reader_gone and result.status == 128 + signal.SIGPIPE
    diag = None
    # A signal forwarded to the job (Ctrl-C, the scheduler) means the job was stopped on purpose.
    stop = ""
    if piped_away:
        stop = "the reader of its output went away"
    elif result.signals_forwarded:
        stop = f"signal {_signame(result.signals_forwarded[0])} was forwarded to the job: it was stopped from outside"
    if result.status != 0 and not piped_away:
        try:
            hook.armed = True
            if hook.pending is not None:
                raise _Stopped(hook.pending)
            diag = _on_failure(opts, me, result.status, env, hook, attempts)
        except _Stopped as e:
            _say(
                f"ckptguard run: signal {e.signum} received: the diagnosis was cut short; "
                f"the output is kept in {me.dir}\n"
            )
            stop = f"signal {_signame(e.signum)} received"
    if diag is not None and diag.found:
        attempt.failure = diag.kind or diag.failure_class
    return result.status, diag, stop


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


class _Stopped(BaseException):
    """A signal to the runner after the child's exit: end the diagnosis early (not an Exception,
    so no handler of the diagnosis stage swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Hook:
    """The --on-failure process while it runs: signals to the runner are passed to its group."""

    proc: subprocess.Popen[bytes] | None = None
    armed = False  # the diagnosis has begun: a signal now ends it
    pending: int | None = None  # a signal that came after the child's exit, before the diagnosis


@contextlib.contextmanager
def _signals_end_early() -> Iterator[_Hook]:
    """After the child's exit, a signal to the runner ends the diagnosis (or is passed to the
    --on-failure command's group) instead of ending the runner: its status stays the child's."""
    hook = _Hook()

    def handler(signum: int, _frame: FrameType | None) -> None:
        if hook.proc is not None:
            if hook.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(hook.proc.pid, signum)
            return
        if hook.armed:
            raise _Stopped(signum)
        hook.pending = signum

    previous = {s: signal.signal(s, handler) for s in FORWARDED}
    try:
        yield hook
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _on_failure(
    opts: RunOptions,
    me: logdir.HostRun,
    status: int,
    env: Mapping[str, str],
    hook: _Hook,
    attempts: Sequence[Attempt] = (),
) -> Diagnosis | None:
    """Diagnose the whole job, print the summary, write the reports, run --on-failure. No failure
    of one stage (an unreadable log, an unreachable checkpoint root) suppresses the others."""
    from ckptguard.runner import report

    runs = [me]
    try:
        runs = logdir.wait_for_job(me, opts.logs, opts.grace_s)
    except Exception as e:  # this node's own logs are still there to read
        _say(f"ckptguard run: could not look for the job's other runs in {opts.logs} ({type(e).__name__}: {e})\n")
    diag = None
    problem = None
    try:
        diag = report.diagnose_runs(runs)
    except Exception as e:  # the child's status is what matters; the diagnosis is a bonus
        problem = f"could not diagnose the failure ({type(e).__name__}: {e})"
    resume = None
    if opts.checkpoints is not None:
        from ckptguard.resume import ResumeInfo, resume_info

        try:
            resume = resume_info(opts.checkpoints, deep=opts.deep)
        except Exception as e:  # the section says why it has no answer
            resume = ResumeInfo(
                None,
                opts.checkpoints,
                checked="deep" if opts.deep else "quick",
                resume_hint=f"no answer: cannot read {opts.checkpoints}: {type(e).__name__}: {e}",
            )
    paths = None
    try:
        paths = report.write_reports(
            me.dir,
            diag,
            resume,
            runs,
            problem=problem,
            attempts=[a.to_json() for a in attempts] if len(attempts) > 1 else None,
        )
    except Exception as e:
        _say(f"ckptguard run: could not write the report into {me.dir} ({type(e).__name__}: {e})\n")
    if diag is not None:
        _say(report.summary(diag, resume, status, runs, paths, me))
    else:
        _say(f"ckptguard run: {problem}; the output is kept in {me.dir}\n")
        if resume is not None:
            _say("".join(f"  {x}\n" for x in report.resume_lines(resume)))
    if paths is not None:
        logdir.finish(me, report_json=paths[0], report_html=paths[1])
    if opts.on_failure:
        from ckptguard.diagnose.report import masked

        # What ckptguard adds is masked like the reports; the rest is the user's own environment.
        failure_class = (diag.failure_class or "") if diag is not None else ""
        hook_env = {
            **env,
            **masked(
                {
                    "CKPTGUARD_EXIT_STATUS": str(status),
                    "CKPTGUARD_LOG_DIR": me.dir,
                    "CKPTGUARD_REPORT_JSON": paths[0] if paths else "",
                    "CKPTGUARD_REPORT_HTML": paths[1] if paths else "",
                    "CKPTGUARD_FAILURE_CLASS": failure_class,
                }
            ),
        }
        hook.proc = subprocess.Popen(opts.on_failure, shell=True, env=hook_env, start_new_session=True)
        wait_in_steps(hook.proc)
        rc = hook.proc.returncode
        if rc != 0:
            _say(f"ckptguard run: --on-failure command exited with status {rc}\n")
    return diag
