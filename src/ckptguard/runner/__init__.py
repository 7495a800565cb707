"""`ckptguard run`: run any launcher command, pass its output through, keep it, and explain a failure.

The pieces: ``child`` (spawn, pass-through over pipes or pseudo-terminals, signal forwarding),
``capture`` (the kept bytes, head and tail, arrival times), ``logdir`` (one subdirectory per host
and run, finding a job's other hosts), ``report`` (the whole-job diagnosis and resume section).
The exit status is always the child's; the runner's own refusals happen before the child starts
(125: options or log directory, 126: not executable, 127: command not found).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

from ckptguard.runner import logdir
from ckptguard.runner.capture import DEFAULT_CAP, StreamCapture
from ckptguard.runner.child import FORWARDED, CommandNotFound, run_child, wait_in_steps

RUNNER_ERROR = 125
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
    job_id = opts.job_id or logdir.job_id_from_env(env)
    opts.logs = os.path.abspath(opts.logs)
    try:
        me = logdir.create(opts.logs, list(opts.command), job_id)
        out = StreamCapture(me.dir, "stdout", opts.max_log_bytes)
        err = StreamCapture(me.dir, "stderr", opts.max_log_bytes)
    except (logdir.LogDirError, OSError) as e:
        _say(f"ckptguard run: {e}\n")
        return RUNNER_ERROR
    # Installed before the child starts, so that no signal after its exit finds the default
    # handler (which would end the runner with a status that is not the child's).
    with _signals_end_early() as hook:
        return _run_and_explain(opts, env, me, out, err, hook)


def _run_and_explain(opts: RunOptions, env: Mapping[str, str], me: logdir.HostRun, out: StreamCapture,
                     err: StreamCapture, hook: _Hook) -> int:
    try:
        result = run_child(opts.command, child_env(env, me), out, err)
    except CommandNotFound as e:
        out.close()
        err.close()
        logdir.finish(me, ended_at=me.started, exit_status=e.status, error=str(e))
        _say(f"ckptguard run: {e}\n")
        return e.status
    out.close()
    err.close()
    logdir.finish(me, ended_at=result.ended_at, exit_status=result.status,
                  signals_forwarded=result.signals_forwarded)
    if result.signal is not None:
        logdir.record_exit(me, result.signal)
    for cap in (out, err):
        if cap.failure is not None:
            _say(f"ckptguard run: {cap.failure} (in {me.dir}); the output was passed through whole\n")
    # Killed by SIGPIPE after our reader left (`ckptguard run ... | head`): how such a pipeline
    # ends, not a failure to explain.
    piped_away = result.reader_gone and result.status == 128 + signal.SIGPIPE
    if result.status != 0 and not piped_away:
        try:
            hook.armed = True
            if hook.pending is not None:
                raise _Stopped(hook.pending)
            _on_failure(opts, me, result.status, env, hook)
        except _Stopped as e:
            _say(f"ckptguard run: signal {e.signum} received: the diagnosis was cut short; "
                 f"the output is kept in {me.dir}\n")
    return result.status


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


def _on_failure(opts: RunOptions, me: logdir.HostRun, status: int, env: Mapping[str, str], hook: _Hook) -> None:
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
            resume = ResumeInfo(None, opts.checkpoints, checked="deep" if opts.deep else "quick",
                                resume_hint=f"no answer: cannot read {opts.checkpoints}: {type(e).__name__}: {e}")
    paths = None
    try:
        paths = report.write_reports(me.dir, diag, resume, runs, problem=problem)
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
        hook_env = {**env, **masked({"CKPTGUARD_EXIT_STATUS": str(status), "CKPTGUARD_LOG_DIR": me.dir,
                                     "CKPTGUARD_REPORT_JSON": paths[0] if paths else "",
                                     "CKPTGUARD_REPORT_HTML": paths[1] if paths else "",
                                     "CKPTGUARD_FAILURE_CLASS": failure_class})}
        hook.proc = subprocess.Popen(opts.on_failure, shell=True, env=hook_env, start_new_session=True)
        wait_in_steps(hook.proc)
        rc = hook.proc.returncode
        if rc != 0:
            _say(f"ckptguard run: --on-failure command exited with status {rc}\n")
