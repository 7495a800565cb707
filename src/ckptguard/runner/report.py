"""The whole-job answer after a failure: diagnosis of every host's logs, plus the resume section.

Used by `ckptguard run` (on failure) and by `ckptguard diagnose` on a run's log directory, so
both give the same answer. The diagnosis engine reads the captured ``stdout.log``/``stderr.log``
of each host run; where it cannot tell the host of the rank that failed first, the host run
whose log holds that rank's evidence names it.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import shlex
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptguard.runner.logdir import HostRun

if TYPE_CHECKING:
    from ckptguard.diagnose.model import Diagnosis
    from ckptguard.resume import ResumeInfo


def diagnose_runs(runs: Sequence[HostRun], *, mask_hosts: bool = False) -> Diagnosis:
    """Diagnose the captured logs of ``runs`` together (raises the engine's UsageError if none)."""
    from ckptguard.diagnose.engine import diagnose

    files = [f for r in runs for f in r.log_files()]
    diag = diagnose(files, mask_hosts=mask_hosts)
    if not mask_hosts:
        _fill_host(diag, runs)
    _interrupted(diag, runs)
    _hang(diag, runs)
    diag.notes += [w for r in runs for w in r.warnings]
    return diag


def _hang(diag: Diagnosis, runs: Sequence[HostRun]) -> None:
    """When a runner stopped the job for making no progress (--hang-timeout), that is the answer:
    the rank that stopped, named from every node's stacks; what the job printed when it was
    stopped (SIGTERM, lost peers) is the consequence."""
    from ckptguard.runner import hang

    records = [(r, rec) for r in runs if (rec := hang.read_hang(r.dir)) is not None]
    if not records:
        return
    v = hang.stopped_rank([rec for _, rec in records])
    timeout = next((rec.get("timeout_s") for _, rec in records if isinstance(rec.get("timeout_s"), int | float)), None)
    host = None
    stacks = []
    for r, rec in records:
        for p in rec.get("processes") or []:
            if not isinstance(p, dict):
                continue
            if (v.rank is not None and p.get("rank") == v.rank) or (v.rank is None and v.pid == p.get("pid")):
                host = r.host
            if p.get("stack_file"):
                stacks.append(str(p["stack_file"]))
    from ckptguard.diagnose.kb import load_kb

    if diag.found and diag.failure_class:
        diag.notes.append(f"Before: {diag.failure_class}: {diag.title} (the job's reaction to being stopped).")
    kb = load_kb()
    what = {
        "io": "stuck in I/O",
        "collective": "waiting in a collective",
        "other_collective": "in another collective",
        "dataloader": "stuck in the data loader",
        "device": "stuck in a device call",
        "user": "stopped in user code",
        "unknown": "not answering",
    }.get(v.state, v.state)
    diag.found = True
    diag.kind = "nccl_watchdog_timeout"
    diag.failure_class = kb.family(diag.kind)
    diag.category = "distributed"
    secs = f"{timeout:g} s" if timeout is not None else "the --hang-timeout"
    who = f"rank {v.rank}" if v.rank is not None else f"process {v.pid}" if v.pid is not None else "no single rank"
    diag.title = f"Hang: no progress for {secs}; {who} {what}"
    diag.confidence = 0.9 if v.rank is not None else 0.5
    diag.initiating_rank = v.rank
    diag.initiating_host = host
    diag.collateral_ranks = sorted(set(v.waiting) - {v.rank} if v.rank is not None else set(v.waiting))
    diag.also_failed_ranks = list(v.others)
    diag.rank_attribution = "the stacks of every rank captured when the job stopped making progress"
    diag.root_cause = (
        f"The job printed nothing and sent no heartbeat for {secs}, so ckptguard run captured every "
        f"rank's stack and stopped it. {v.text[0].upper()}{v.text[1:]}."
    )
    diag.fix = _HANG_FIX.get(v.state, _HANG_FIX["user"])
    if all(rec.get("hook_ran") is False for _, rec in records):
        diag.root_cause += f" {_NO_HOOK}"
        diag.fix = f"{_NO_HOOK_FIX} {diag.fix}"
    diag.verify_command = (
        "ckptguard run --hang-timeout SECONDS ... (the stacks are in stacks/ of the log directory; "
        "py-spy dump --pid PID shows the native frames)"
    )
    diag.notes.append("Stacks: " + ", ".join(stacks) if stacks else "No stack was captured.")


_HANG_FIX = {
    "io": "Find out why that path does not answer (a stalled NFS or FUSE mount, a FIFO with no writer, a lock "
    "held elsewhere); for the checkpoint path, check the file system's server and mount options "
    "(soft/timeo) before resuming.",
    "dataloader": "Look at the data loader's workers (a worker blocked on I/O or a lock, a dataset's __getitem__ "
    "that never returns); set DataLoader(timeout=...) so that a stuck worker raises.",
    "other_collective": "Make every rank call the same collectives in the same order: no collective inside a "
    "rank-dependent branch.",
    "device": "A device call that never returns: check the GPU (nvidia-smi, Xid errors in dmesg) and whether a "
    "peer's kernel waits on this one; CUDA_LAUNCH_BLOCKING=1 names the kernel.",
    "user": "Look at the stopped rank's stack: that code waits or loops without end (a lock, a sleep, a busy loop, "
    "a rank-dependent branch).",
    "collective": "Every captured rank waits in the same collective: the rank they wait for is elsewhere (another "
    "node's stacks in the log directory, or a rank that exited); read its log.",
}


_NO_HOOK = (
    "No process of the job ran ckptguard's startup hook (the launcher or a wrapper replaced PYTHONPATH), "
    "so no Python stack was captured and imports did not count as progress; only each process's "
    "blocked system call and kernel wait were read from /proc."
)
_NO_HOOK_FIX = (
    "Keep ckptguard's hook directory on PYTHONPATH where the job sets its own: PYTHONPATH=.:$PYTHONPATH "
    "instead of PYTHONPATH=. (in the launcher command or the wrapper script)."
)


#: Signals whose forwarding by the runner means the job was stopped from outside.
_INTERRUPTS = {
    int(signal.SIGINT): "SIGINT (Ctrl-C)",
    int(signal.SIGTERM): "SIGTERM (the scheduler, a time limit, preemption or a person)",
    int(signal.SIGHUP): "SIGHUP (the terminal closed)",
}


def _interrupted(diag: Diagnosis, runs: Sequence[HostRun]) -> None:
    """When a runner forwarded SIGINT/SIGTERM/SIGHUP to the command, that is the answer: the job
    was interrupted from outside; what it printed afterwards (a KeyboardInterrupt traceback, the
    launcher tearing ranks down) is its reaction, not a bug."""
    for r in runs:
        sent = [s for s in r.record.get("signals_forwarded") or [] if s in _INTERRUPTS]
        if not sent:
            continue
        what = _INTERRUPTS[sent[0]]
        host = r.host
        from ckptguard.diagnose.kb import load_kb

        # Ctrl-C is a stop on purpose, never the scheduler's: the hooks receive it as such
        kind = "interrupted" if sent[0] == int(signal.SIGINT) else "launcher_sigterm"
        if diag.found and diag.failure_class and diag.kind not in ("launcher_sigterm", "interrupted"):
            diag.notes.append(f"Before: {diag.failure_class}: {diag.title} (the job's reaction to the interruption).")
        diag.found = True
        diag.kind = kind
        diag.failure_class = load_kb().family(diag.kind)
        diag.category = "launcher"
        diag.title = f"Interrupted: ckptguard run on {host} forwarded {what} to the command"
        diag.confidence = 0.95
        diag.initiating_rank = None
        diag.initiating_host = host
        diag.root_cause = (
            f"The job was interrupted from outside: ckptguard run on {host} received {what} and "
            f"forwarded it to the command. Not a bug in the code; what the job printed after it is "
            f"its reaction."
        )
        diag.fix = (
            "Nothing to fix in the code. Rerun (resuming from the step below) when the interruption was "
            "intended; if it came from the scheduler, check the time limit or the preemption policy."
        )
        diag.verify_command = "sacct -j $SLURM_JOB_ID --format=JobID,State,ExitCode,Elapsed  # or your scheduler's log"
        return


def _fill_host(diag: Diagnosis, runs: Sequence[HostRun]) -> None:
    if not diag.found or diag.initiating_host or diag.initiating_rank is None:
        return
    host_of = {f: r.host for r in runs for f in r.log_files()}
    for e in diag.evidence:
        if e.role == "initiating" and e.rank == diag.initiating_rank and e.file in host_of:
            diag.initiating_host = host_of[e.file]
            return


def job_json(diag: Diagnosis, resume: ResumeInfo | None, runs: Sequence[HostRun]) -> dict[str, Any]:
    """The diagnosis JSON (its schema is on the Diagnosis page) with ``resume`` (when asked), the host runs
    read and, after a hang, ``hang``: every rank's state and stack; every string masked (the job's command
    line included)."""
    from ckptguard.diagnose.report import masked

    out: dict[str, Any] = diag.to_dict()
    if resume is not None:
        out["resume"] = resume.to_json()
    out["runs"] = _runs_json(runs)
    hang_json = _hang_json(runs)
    if hang_json is not None:
        out["hang"] = hang_json
    return masked(out)


def _hang_json(runs: Sequence[HostRun]) -> dict[str, Any] | None:
    from ckptguard.runner import hang

    records = [(r, rec) for r in runs if (rec := hang.read_hang(r.dir)) is not None]
    if not records:
        return None
    v = hang.stopped_rank([rec for _, rec in records])
    ranks = []
    for r, rec in records:
        for p in rec.get("processes") or []:
            if isinstance(p, dict):
                raw = p.get("threads")
                threads = raw if isinstance(raw, list) else []
                ranks.append(
                    {
                        "host": r.host,
                        "rank": p.get("rank"),
                        "pid": p.get("pid"),
                        "ppid": p.get("ppid"),
                        "state": p.get("state"),
                        "detail": p.get("detail"),
                        "syscall": p.get("syscall"),
                        "path": p.get("path"),
                        "wchan": p.get("wchan"),
                        "stack_file": p.get("stack_file"),
                        "stack": hang.stack_text(threads),
                    }
                )
    stopped = next(
        (p for p in ranks if (v.rank is not None and p["rank"] == v.rank) or (v.rank is None and p["pid"] == v.pid)),
        {},
    )
    return {
        "stopped_rank": v.rank,
        # the stopped process when no rank is known (named by pid), or the one process of the job
        "stopped_pid": v.pid,
        "hook_ran": any(rec.get("hook_ran") is not False for _, rec in records),
        "state": v.state,
        "detail": v.detail,
        "collective": v.collective,
        "syscall": stopped.get("syscall"),
        "path": stopped.get("path"),
        "waiting_ranks": v.waiting,
        "explanation": v.text,
        "timeout_s": records[0][1].get("timeout_s"),
        "processes": ranks,
    }


def _runs_json(runs: Sequence[HostRun]) -> list[dict[str, Any]]:
    return [
        {
            "dir": r.dir,
            "host": r.host,
            "job_id": r.job_id,
            "exit_status": r.record.get("exit_status"),
            "command": r.record.get("command"),
        }
        for r in runs
    ]


def resume_lines(resume: ResumeInfo) -> list[str]:
    """The resume section as plain lines (the same in the terminal summary and `diagnose`)."""
    checks = (
        "every byte checksummed"
        if resume.checked == "deep"
        else "quick checks: manifest and file sizes; --deep checksums every byte"
    )
    lines = []
    if resume.step is not None:
        lines.append(f"resume from  step {resume.step} of {resume.root} (committed last and intact; {checks})")
        lines.append(f"             {resume.resume_hint}")
    else:
        lines.append(f"resume from  {resume.resume_hint}")
    for u in resume.unsafe:
        lines.append(f"not safe     step {u.step}: {u.reason}")
    return lines


def resume_html(resume: ResumeInfo) -> str:
    e = html.escape
    unsafe = "".join(f"<li>step {u.step}: {e(u.reason)}</li>" for u in resume.unsafe) or "<li>none</li>"
    head = (
        f"<p>Resume from <b>step {resume.step}</b> of <code>{e(resume.root)}</code> "
        f"(committed last and intact, {e(resume.checked)} checks):</p><pre class=code>{e(resume.resume_hint)}</pre>"
        if resume.step is not None
        else f"<p>{e(resume.resume_hint)}</p>"
    )
    return f"<h2>Resume</h2>{head}<h3>Not safe</h3><ul>{unsafe}</ul>"


def encodable(value: Any) -> Any:
    """``value`` with every string made valid UTF-8: bytes that came in through surrogateescape (a
    non-UTF-8 argument or path) become backslash escapes, so a report can always be written."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-8", "surrogateescape" if _only_escapes(value) else "backslashreplace").decode(
                "utf-8", "backslashreplace"
            )
    if isinstance(value, dict):
        return {encodable(k): encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encodable(v) for v in value]
    return value


def _only_escapes(text: str) -> bool:
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in text)


def _write_atomic(path: str, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_reports(
    directory: str,
    diag: Diagnosis | None,
    resume: ResumeInfo | None,
    runs: Sequence[HostRun],
    *,
    problem: str | None = None,
    attempts: list[dict[str, Any]] | None = None,
) -> tuple[str, str]:
    """``report.json`` and ``report.html`` in ``directory``, each written whole; their paths. With
    no diagnosis (``problem`` says why), the reports carry the resume section and the runs read."""
    from ckptguard.diagnose.report import masked

    json_path = os.path.join(directory, "report.json")
    html_path = os.path.join(directory, "report.html")
    resume, runs, problem = masked(resume), [masked(r) for r in runs], masked(problem)
    if diag is not None:
        data = job_json(diag, resume, runs)
    else:
        data = {"found": False, "error": problem or "no diagnosis", "runs": _runs_json(runs)}
        if resume is not None:
            data["resume"] = resume.to_json()
    if attempts is not None:
        data["attempts"] = attempts
    _write_atomic(json_path, json.dumps(encodable(data), indent=2, ensure_ascii=False) + "\n")
    extra = (resume_html(resume) if resume is not None else "") + _runs_html(runs) + _hang_html(data.get("hang"))
    if diag is not None:
        from ckptguard.diagnose.report import render_html

        page = render_html(diag).replace("</body>", extra + "\n</body>", 1)
    else:
        page = (
            f"<!doctype html><html><head><meta charset=utf-8><title>ckptguard run</title></head><body>"
            f"<h1>No diagnosis</h1><p>{html.escape(problem or '')}</p>{extra}\n</body></html>\n"
        )
    _write_atomic(html_path, page)
    return json_path, html_path


def _hang_html(h: Any) -> str:
    if not isinstance(h, dict):
        return ""
    e = html.escape
    parts = [f"<h2>Stacks at the hang</h2><p>{e(str(h.get('explanation', '')))}</p>"]
    for p in h.get("processes", []):
        who = f"rank {p['rank']}" if p.get("rank") is not None else f"pid {p.get('pid')}"
        parts.append(
            f"<h3>{e(who)} on {e(str(p.get('host')))}: {e(str(p.get('detail')))}</h3>"
            f"<pre class=code>{e(str(p.get('stack', '')))}</pre>"
        )
    return "".join(parts)


def _runs_html(runs: Sequence[HostRun]) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(r.host)}</td><td>{e(str(r.record.get('exit_status')))}</td><td><code>{e(r.dir)}</code></td></tr>"
        for r in runs
    )
    return f"<h2>Hosts read</h2><table><tr><th>host</th><th>exit status</th><th>logs</th></tr>{rows}</table>"


def summary(
    diag: Diagnosis,
    resume: ResumeInfo | None,
    status: int,
    runs: Sequence[HostRun],
    report_paths: tuple[str, str] | None,
    me: HostRun | None = None,
) -> str:
    """The compact summary `ckptguard run` prints on stderr after a failure."""
    from ckptguard.diagnose.model import ranges

    hosts = ", ".join(sorted({r.host for r in runs}))
    lines = [
        f"ckptguard run: the command failed (exit status {status}); diagnosis of the logs of "
        f"{len(runs)} host run(s) ({hosts}):"
    ]
    if diag.found:
        kind = f" ({diag.kind.replace('_', ' ')})" if diag.kind and diag.kind != diag.failure_class else ""
        lines.append(
            f"  failure      {diag.failure_class}{kind}: {diag.title} (confidence {diag.confidence:.2f}, "
            f"{diag.confidence_label})"
        )
        first = "unknown" if diag.initiating_rank is None else f"rank {diag.initiating_rank}"
        if diag.initiating_host:
            first += f" on {diag.initiating_host}"
        lines.append(f"  first        {first}")
        lines.append(f"  collateral   {ranges(diag.collateral_ranks) if diag.collateral_ranks else 'none'}")
        if diag.also_failed_ranks:
            lines.append(f"  also failed  {ranges(diag.also_failed_ranks)}")
        lines.append(f"  root cause   {diag.root_cause}")
        fix = diag.fix.split(" ckptguard's Checkpointer prevents")[0].strip()
        lines.append(f"  fix          {fix}")
        lines.append(f"  verify       $ {diag.verify_command}")
        for r in runs:
            if os.path.exists(os.path.join(r.dir, "hang.json")):
                lines.append(f"  stacks       {os.path.join(r.dir, 'stacks')} (every Python process, all threads)")
    else:
        lines.append("  failure      none recognised in the captured output: " + " ".join(diag.notes))
    if resume is not None:
        lines += ["  " + x for x in resume_lines(resume)]
    if report_paths is not None:
        lines.append(f"  report       {report_paths[1]} (JSON: {report_paths[0]})")
    # A host run's own directory selects its job, whatever other jobs share the log directory.
    one = me.dir if me is not None else (runs[0].dir if runs else ".")
    lines.append(f"  all nodes    $ ckptguard diagnose {shlex.quote(one)}")
    return "\n".join(lines) + "\n"
