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
from ckptguard.cli.output import console


@app.command()
def diagnose(
    paths: Annotated[list[str], typer.Argument(help="Log files, directories of per-rank logs, or - for stdin.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (schema_version 1).")] = False,
    html_out: Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML report.")] = None,
    mask_hosts: Annotated[bool, typer.Option(
        "--mask-hosts", help="Also mask hostnames, IP addresses and user names in paths.")] = False,
) -> None:
    """Name the failure, the rank that failed first and the collateral ranks of a crashed run."""
    from ckptguard.diagnose.engine import diagnose as run
    from ckptguard.diagnose.ingest import UsageError
    from ckptguard.diagnose.report import render_html, render_text, to_json

    try:
        diag = run(paths, mask_hosts=mask_hosts)
    except UsageError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if html_out is not None:
        try:
            html_out.write_text(render_html(diag), encoding="utf-8")
        except OSError as exc:
            typer.echo(f"error: cannot write {html_out}: {exc}", err=True)
            raise typer.Exit(2) from exc
    if json_out:
        sys.stdout.write(to_json(diag) + "\n")
    else:
        render_text(diag, console(highlight=False))
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
