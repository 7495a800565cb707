"""`ckptguard ls` and `ckptguard verify`: what a checkpoint root holds, and whether it is intact.

Exit codes: 0 all checked checkpoints intact, 1 any is not, 2 usage errors
(including a PATH that is not a directory). JSON output is documented in
docs/verify.md (schema_version 1).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ckptguard.cli import app
from ckptguard.cli.output import console
from ckptguard.progress import ByteProgress

PathArg = Annotated[str, typer.Argument(help="The checkpoint root directory.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _when(ts: float | None) -> str:
    if ts is None:
        return "?"
    return datetime.datetime.fromtimestamp(ts).strftime("%m-%d %H:%M:%S")


def _usage_error(message: str) -> typer.Exit:
    console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(2)


def _listing(path: str) -> Any:
    from ckptguard.errors import CheckpointError
    from ckptguard.verify import list_root

    try:
        return list_root(path)
    except CheckpointError as e:
        raise _usage_error(str(e)) from None


@app.command("ls")
def ls_command(path: PathArg, json_out: JsonOpt = False) -> None:
    """List committed checkpoints, attempts in progress or abandoned, and leftovers."""
    listing = _listing(path)
    if json_out:
        typer.echo(json.dumps(listing.to_json(), indent=2))
        return
    con = console()
    table = Table(title=f"checkpoints in {listing.root}", title_justify="left")
    for col in ("#", "step", "dir", "state", "created", "size", "metadata"):
        table.add_column(col, no_wrap=col != "metadata")
    for c in listing.checkpoints:  # in commit order: the last committed is at the bottom
        state = "bad manifest" if c.manifest_error else ("latest" if c.latest else
                                                          "superseded" if not c.current else
                                                          "abandoned (rolled back)" if c.abandoned else "committed")
        table.add_row("" if c.seq is None else str(c.seq), str(c.step), c.dir, state, _when(c.created_at),
                      _human_bytes(c.bytes), json.dumps(c.user_metadata) if c.user_metadata else "")
    con.print(table)
    if not listing.checkpoints:
        con.print("no committed checkpoint")
    for a in listing.attempts:
        con.print(f"attempt {a.state}: step {a.step} ({_human_bytes(a.bytes)}, {a.age_s:.0f} s old) {a.dir}")
    for t in listing.trash:
        con.print(f"being deleted: {t}")
    _latest_note(con, listing)
    if listing.lease:
        lease = listing.lease
        con.print(f"lease: {'held' if lease['live'] else 'expired'} by host {lease['host']} pid {lease['pid']}"
                      + (f" ({lease['job']})" if lease.get("job") else ""))


def _latest_note(con: Console, listing: Any) -> None:
    if listing.latest_error:
        con.print(f"note: the `latest` pointer is unreadable ({listing.latest_error}). It is a hint for other "
                  "tools; ckptguard lists the checkpoints themselves, so no checkpoint is affected. The next "
                  "save rewrites it.", highlight=False, soft_wrap=True)


@app.command("verify")
def verify_command(
    path: PathArg,
    step: Annotated[int | None, typer.Option("--step", help="Verify only this step (default: every committed one).")] = None,
    json_out: JsonOpt = False,
    threads: Annotated[int, typer.Option("--threads", min=1, max=64, help="Files read in parallel.")] = 4,
) -> None:
    """Re-read every byte of the checkpoints and check sizes and checksums against their manifests."""
    from ckptguard.protocol.layout import CheckpointName
    from ckptguard.verify import SCHEMA_VERSION, checkpoint_bytes, verify_checkpoint

    listing = _listing(path)
    current = [c for c in listing.checkpoints if c.current]
    if step is not None:
        current = [c for c in current if c.step == step]
        if not current:
            raise _usage_error(f"step {step} is not a committed checkpoint in {listing.root}; committed: "
                               f"{sorted(c.step for c in listing.checkpoints if c.current) or 'none'}")
    names = [CheckpointName(c.step, c.version) for c in current]
    total = sum(checkpoint_bytes(listing.root, n) for n in names)
    results = []
    with ByteProgress(not json_out and Console(stderr=True).is_terminal, "verifying", total) as bar:
        for n in names:
            results.append(verify_checkpoint(listing.root, n, threads=threads, on_bytes=bar.callback))
    intact = [r for r in results if r.intact]
    safe = intact[-1].step if intact else None  # listed in commit order: the last intact one is committed last
    ok = all(r.intact for r in results)
    if json_out:
        from dataclasses import asdict

        typer.echo(json.dumps({
            "schema_version": SCHEMA_VERSION, "root": listing.root, "intact": ok,
            "safe_to_resume": safe, "checked": [asdict(r) for r in results],
            "attempts": [asdict(a) for a in listing.attempts], "latest_error": listing.latest_error,
        }, indent=2))
        raise typer.Exit(0 if ok else 1)
    con = console()
    table = Table(title=f"verify {listing.root}", title_justify="left")
    for col in ("step", "dir", "result", "files", "size", "seconds"):
        table.add_column(col, no_wrap=True)
    for r in results:
        table.add_row(str(r.step), r.dir, "[green]intact[/green]" if r.intact else "[red]NOT INTACT[/red]",
                      str(r.files_checked), _human_bytes(r.bytes_checked), f"{r.seconds:.2f}")
    con.print(table)
    for r in results:
        for p in r.problems[:20]:
            con.print(f"step {r.step}: {p.kind}: {os.path.relpath(p.path, listing.root)}: {p.detail}",
                          highlight=False, soft_wrap=True)
        if len(r.problems) > 20:
            con.print(f"step {r.step}: ... and {len(r.problems) - 20} more problems")
    if not results:
        con.print("no committed checkpoint to verify")
    for a in listing.attempts:
        con.print(f"note: attempt {a.state} for step {a.step} in {a.dir} (never counts as a checkpoint)")
    _latest_note(con, listing)
    if step is None:
        con.print(f"safe to resume from: step {safe}" if safe is not None else "no intact checkpoint to resume from")
    raise typer.Exit(0 if ok else 1)
