"""`ckptguard diagnose` and `ckptguard explain`: offline diagnosis of crashed multi-rank runs.

Nothing here imports torch: diagnosing logs must start fast and work on a laptop.
Exit codes: 0 a failure was diagnosed, 1 none was found, 2 usage error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from ckptguard.cli import app
from ckptguard.cli.output import console, say


@app.command()
def diagnose(
    paths: Annotated[list[str], typer.Argument(help="Log files, directories of per-rank logs, or - for stdin.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (schema_version 1).")] = False,
    html_out: Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML report.")] = None,
    mask_hosts: Annotated[
        bool, typer.Option("--mask-hosts", help="Also mask hostnames, IP addresses and user names in paths.")
    ] = False,
    checkpoints: Annotated[
        str | None, typer.Option("--checkpoints", help="Checkpoint root (path or s3://): add the step to resume from.")
    ] = None,
    deep: Annotated[bool, typer.Option("--deep", help="With --checkpoints: checksum every byte.")] = False,
) -> None:
    """Name the failure, the rank that failed first and the collateral ranks of a crashed run.

    A `ckptguard run` log directory is read as its job: every host's captured output merged.
    """
    from ckptguard.diagnose.engine import diagnose as run
    from ckptguard.diagnose.ingest import UsageError
    from ckptguard.diagnose.report import masked, render_html, render_text, to_json
    from ckptguard.runner import logdir, report

    job = logdir.runs_for_path(paths[0]) if len(paths) == 1 else None
    try:
        if job is not None:
            diag = report.diagnose_runs(job[0], mask_hosts=mask_hosts)
            if not mask_hosts:
                diag.notes.append(f"Read {job[1]}.")
        else:
            diag = run(paths, mask_hosts=mask_hosts)
    except UsageError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    resume = None
    if checkpoints is not None:
        from ckptguard.resume import resume_info

        resume = masked(resume_info(checkpoints, deep=deep))
    if html_out is not None:
        try:
            page = render_html(diag)
            if resume is not None:
                page = page.replace("</body>", report.resume_html(resume) + "\n</body>", 1)
            html_out.write_text(page, encoding="utf-8")
        except OSError as exc:
            typer.echo(f"error: cannot write {html_out}: {exc}", err=True)
            raise typer.Exit(2) from exc
    if json_out:
        if resume is None and job is None:
            sys.stdout.write(to_json(diag) + "\n")
        else:
            out = report.job_json(diag, resume, job[0] if job is not None else [])
            if job is None or mask_hosts:  # the host runs name hosts and paths
                out.pop("runs")
            sys.stdout.write(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
    else:
        con = console(highlight=False)
        render_text(diag, con)
        if resume is not None:
            con.print("\n[bold]Resume[/bold]")
            for line in report.resume_lines(resume):
                say(con, "  " + line)
    raise typer.Exit(0 if diag.found else 1)


@app.command()
def explain(
    failure_class: Annotated[str | None, typer.Argument(help="A class id; omit to list all classes.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the entry as JSON.")] = False,
) -> None:
    """Explain a failure class of the knowledge base: mechanism, fix, prevention, verification."""
    from ckptguard.diagnose.kb import load_kb
    from ckptguard.diagnose.report import render_explain

    kb = load_kb()
    out = console(highlight=False)
    if failure_class is None:
        if json_out:
            sys.stdout.write(json.dumps({c: kb[c].title for c in sorted(kb.classes)}, indent=2) + "\n")
        else:
            for cid in sorted(kb.classes):
                out.print(f"{cid:34s} {kb[cid].title}", markup=False)
        return
    if failure_class not in kb:
        typer.echo(f"error: unknown class {failure_class!r}; `ckptguard explain` lists them", err=True)
        raise typer.Exit(2)
    if json_out:
        sys.stdout.write(json.dumps(kb[failure_class].as_dict(), indent=2) + "\n")
    else:
        render_explain(kb[failure_class], out)
