"""`ckptguard ls` and `ckptguard verify`: what a checkpoint root holds, and whether it is intact.

PATH is a checkpoint root or a directory holding some (a Trainer ``output_dir``, a Lightning
``dirpath``, an Accelerate ``project_dir``, a DeepSpeed save directory, a torchtitan dump folder,
a directory of runs): every root found is reported, with the framework that wrote it.
Exit codes: 0 all checked checkpoints intact, 1 any is not, 2 usage errors (including a PATH
that is not a directory), 3 no ckptguard root at or under PATH. JSON output is documented on the
Verification page (schema_version 1).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ckptguard.cli import app, fail
from ckptguard.cli.output import console, say, text
from ckptguard.frameworks import described_dirs_text
from ckptguard.progress import ByteProgress

PathArg = Annotated[
    str,
    typer.Argument(
        help=f"A checkpoint root, or a directory holding some ({described_dirs_text()}, a directory of runs)."
    ),
]
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
    return fail(message, 2)


NO_ROOT_EXIT = 3


def _roots(path: str, json_out: bool, verifying: bool = False) -> tuple[list[Any], bool]:
    """The roots at or under ``path``, and whether ``path`` is itself the one root; exit 3 if none."""
    from ckptguard.discover import find_roots
    from ckptguard.errors import CheckpointError
    from ckptguard.frameworks import hidden_roots_text
    from ckptguard.storage import open_storage

    unreadable: list[str] = []
    strays: list[str] = []
    try:
        roots = find_roots(path, unreadable=unreadable, strays=strays)
        given = open_storage(path).root
    except CheckpointError as e:
        raise _usage_error(str(e)) from None
    for skipped in unreadable:
        say(console(stderr=True), f"note: skipped {skipped}: permission denied (not searched for checkpoint roots)")
    for stray in strays:
        say(
            console(stderr=True),
            f"note: skipped {stray}: not a directory (a file, FIFO or link named like a "
            "root's control directory; not opened)",
        )
    if not roots:
        if json_out:
            doc: dict[str, Any] = {"schema_version": 1, "path": given, "roots": []}
            if verifying:
                doc["intact"] = False  # nothing was verified: never reported as intact
            typer.echo(json.dumps(doc, indent=2))
        say(
            console(stderr=True),
            f"{given} holds no ckptguard checkpoint root (looked at it and below it, including the "
            f"{hidden_roots_text()} directories the integrations write){_step_dir_hint(given)}",
        )
        raise typer.Exit(NO_ROOT_EXIT)
    return roots, len(roots) == 1 and roots[0].path == given


def _step_dir_hint(given: str) -> str:
    """For a checkpoint's own directory (``ROOT/step-00000001``): the command on its root that was meant."""
    from ckptguard.protocol.layout import CheckpointName

    name = CheckpointName.parse(os.path.basename(os.path.normpath(given)))
    if name is None:
        return ""
    parent = os.path.dirname(os.path.normpath(given))
    return (
        f"; {given} is one checkpoint of the root {parent}: give the root, e.g. "
        f"ckptguard verify {parent} --step {name.step}"
    )


def _listing(path: str) -> Any:
    """The root's listing; a damaged control record makes a listing with ``error`` set (exit 1, "not
    intact"): the damage is in the root, not in how the command was used."""
    from ckptguard.errors import CheckpointError, CorruptCheckpointError, from_os_error
    from ckptguard.verify import damaged_root, list_root

    try:
        return list_root(path)
    except CorruptCheckpointError as e:
        return damaged_root(path, e)
    except CheckpointError as e:
        raise _usage_error(str(e)) from None
    except OSError as e:  # a control entry of the root that is not what it must be (a file for a directory)
        return damaged_root(path, from_os_error(e, e.filename if isinstance(e.filename, str) else path))


def _damage_note(listing: Any) -> None:
    if listing.error:
        say(
            console(stderr=True),
            f"{listing.root}: NOT INTACT: its control records cannot be read "
            f"({listing.error}); no checkpoint of it can be listed or loaded until they "
            "are repaired",
        )


def _title(what: str, root: str, framework: str | None) -> Any:
    return text(f"{what} {root}" + (f" (written by the {framework} integration)" if framework else ""))


@app.command("ls")
def ls_command(path: PathArg, json_out: JsonOpt = False) -> None:
    """List committed checkpoints, attempts in progress or abandoned, and leftovers."""
    roots, direct = _roots(path, json_out)
    listings = [(_listing(r.path), r.framework) for r in roots]
    if json_out:
        docs = [{**listing.to_json(), "framework": framework} for listing, framework in listings]
        doc = docs[0] if direct else {"schema_version": 1, "path": path, "roots": docs}
        typer.echo(json.dumps(doc, indent=2))
    else:
        for listing, framework in listings:
            _print_listing(listing, framework)
    if any(listing.error for listing, _ in listings):
        raise typer.Exit(1)


def _print_listing(listing: Any, framework: str | None) -> None:
    if listing.error:
        _damage_note(listing)
        return
    con = console()
    table = Table(title=_title("checkpoints in", listing.root, framework), title_justify="left")
    for col in ("#", "step", "dir", "state", "created", "size", "metadata"):
        table.add_column(col, no_wrap=col != "metadata")
    for c in listing.checkpoints:  # in commit order: the last committed is at the bottom
        state = (
            "bad manifest"
            if c.manifest_error
            else (
                "quarantined (a load found it corrupt)"
                if c.quarantined
                else "latest"
                if c.latest
                else "superseded"
                if not c.current
                else "abandoned (rolled back)"
                if c.abandoned
                else "committed"
            )
        )
        table.add_row(
            "" if c.seq is None else str(c.seq),
            str(c.step),
            text(c.dir),
            state,
            _when(c.created_at),
            _human_bytes(c.bytes),
            text(json.dumps(c.user_metadata)) if c.user_metadata else "",
        )
    con.print(table)
    if not listing.checkpoints:
        con.print("no committed checkpoint")
    for a in listing.attempts:
        say(con, f"attempt {a.state}: step {a.step} ({_human_bytes(a.bytes)}, {a.age_s:.0f} s old) {a.dir}")
    for t in listing.trash:
        say(con, f"being deleted: {t}")
    _retired_note(con, listing.retired)
    _latest_note(con, listing)
    if listing.lease:
        say(con, _lease_line(listing.lease))


def _lease_line(lease: dict[str, Any]) -> str:
    holder = f"host {lease['host']} pid {lease['pid']}" + (f" ({lease['job']})" if lease.get("job") else "")
    if lease.get("holder_gone"):
        return (
            f"lease: stale: {holder} is no longer running on this host; the next job on this root takes "
            "the lease over at once"
        )
    return f"lease: {'held' if lease['live'] else 'expired'} by {holder}"


def _retired_note(con: Console, retired: list[str]) -> None:
    for path in retired:
        say(
            con,
            f"note: {path} was retired (by the job's retention or a delete) while this command read the "
            "root: gone, not damaged",
        )


def _latest_note(con: Console, listing: Any) -> None:
    for path in listing.unlisted:
        say(
            con,
            f"note: the commit object {path} is not listed by the root's index, so no load finds it (a "
            "retention or delete in progress, or a damaged index). Its data is kept, never collected as "
            "garbage; to load it, restore the index (e.g. from a bucket version) or export it with "
            "`ckptguard export` on its step directory.",
        )
    if listing.latest_error:
        say(
            con,
            f"note: the `latest` pointer is unreadable ({listing.latest_error}). It is a hint for other "
            "tools; ckptguard lists the checkpoints themselves, so no checkpoint is affected. The next "
            "save rewrites it.",
        )


@app.command("verify")
def verify_command(
    path: PathArg,
    step: Annotated[
        int | None, typer.Option("--step", help="Verify only this step (default: every committed one).")
    ] = None,
    json_out: JsonOpt = False,
    threads: Annotated[int, typer.Option("--threads", min=1, max=64, help="Files read in parallel.")] = 4,
) -> None:
    """Re-read every byte of the checkpoints and check sizes and checksums against their manifests."""
    from ckptguard.protocol.layout import CheckpointName
    from ckptguard.verify import SCHEMA_VERSION, checkpoint_bytes, quarantined_result, verify_checkpoint

    roots, direct = _roots(path, json_out, verifying=True)
    plans = []
    skipped: dict[str, list[Any]] = {}  # quarantined checkpoints: judged from their record, not read again
    for found in roots:
        listing = _listing(found.path)
        current = [c for c in listing.checkpoints if c.current]
        if step is not None:
            current = [c for c in current if c.step == step]
        plans.append(
            (found, listing, [(CheckpointName(c.step, c.version), c.seq) for c in current if not c.quarantined])
        )
        skipped[found.path] = [quarantined_result(c, listing.root) for c in current if c.quarantined]
    if (
        step is not None
        and not any(names for _, _, names in plans)
        and not any(skipped.values())
        and not any(lst.error for _, lst, _ in plans)
    ):
        committed = sorted({c.step for _, listing, _ in plans for c in listing.checkpoints if c.current})
        where = plans[0][1].root if len(plans) == 1 else f"any of the {len(plans)} roots under {path}"
        raise _usage_error(f"step {step} is not a committed checkpoint in {where}; committed: {committed or 'none'}")
    total = sum(checkpoint_bytes(listing.root, n) for _, listing, names in plans for n, _ in names)
    checked = []
    with ByteProgress(not json_out and Console(stderr=True).is_terminal, "verifying", total) as bar:
        for found, listing, names in plans:
            results = [
                verify_checkpoint(listing.root, n, threads=threads, on_bytes=bar.callback, seq=seq) for n, seq in names
            ]
            order = [c.dir for c in listing.checkpoints]
            results = sorted(results + skipped[found.path], key=lambda r: order.index(r.dir))
            checked.append((found, listing, results))
    # A step the job's retention retired while it was read is gone, not damaged: it fails nothing.
    ok = all(r.intact or r.retired for _, _, results in checked for r in results) and not any(
        lst.error for _, lst, _ in checked
    )
    if json_out:
        docs = [_verify_json(SCHEMA_VERSION, found.framework, listing, results) for found, listing, results in checked]
        doc = docs[0] if direct else {"schema_version": SCHEMA_VERSION, "path": path, "intact": ok, "roots": docs}
        typer.echo(json.dumps(doc, indent=2))
        raise typer.Exit(0 if ok else 1)
    for found, listing, results in checked:
        _print_verify(found.framework, listing, results, step)
    raise typer.Exit(0 if ok else 1)


def _safe_to_resume(results: list[Any]) -> int | None:
    intact = [r for r in results if r.intact]
    return intact[-1].step if intact else None  # listed in commit order: the last intact one is committed last


def _verify_json(schema: int, framework: str | None, listing: Any, results: list[Any]) -> dict[str, Any]:
    from dataclasses import asdict

    checked = [r for r in results if not r.retired]
    retired = listing.retired + [os.path.join(listing.root, r.dir) for r in results if r.retired]
    return {
        "schema_version": schema,
        "root": listing.root,
        "framework": framework,
        "intact": not listing.error and all(r.intact for r in checked),
        "safe_to_resume": _safe_to_resume(checked),
        "checked": [r.to_json() for r in checked],
        "attempts": [asdict(a) for a in listing.attempts],
        "latest_error": listing.latest_error,
        "error": listing.error,
        "unlisted": listing.unlisted,
        "retired": retired,
    }


def _print_verify(framework: str | None, listing: Any, results: list[Any], step: int | None) -> None:
    if listing.error:
        _damage_note(listing)
        return
    con = console()
    table = Table(title=_title("verify", listing.root, framework), title_justify="left")
    for col in ("step", "dir", "result", "files", "size", "seconds"):
        table.add_column(col, no_wrap=True)
    for r in results:
        result = (
            text("retired", "dim") if r.retired else text("intact", "green") if r.intact else text("NOT INTACT", "red")
        )
        table.add_row(
            str(r.step), text(r.dir), result, str(r.files_checked), _human_bytes(r.bytes_checked), f"{r.seconds:.2f}"
        )
    con.print(table)
    for r in results:
        for p in r.problems[:20]:
            kind = p.kind if p.severity == "error" else f"{p.kind} (warning)"
            say(con, f"step {r.step}: {kind}: {os.path.relpath(p.path, listing.root)}: {p.detail}")
        if len(r.problems) > 20:
            con.print(f"step {r.step}: ... and {len(r.problems) - 20} more problems")
    _retired_note(con, listing.retired + [os.path.join(listing.root, r.dir) for r in results if r.retired])
    if not results and step is not None:
        committed = sorted({c.step for c in listing.checkpoints if c.current})
        say(con, f"step {step} is not a committed checkpoint in {listing.root}; committed: {committed or 'none'}")
    elif not results:
        con.print("no committed checkpoint to verify")
    for a in listing.attempts:
        say(con, f"note: attempt {a.state} for step {a.step} in {a.dir} (never counts as a checkpoint)")
    _latest_note(con, listing)
    if step is None:
        safe = _safe_to_resume(results)
        con.print(f"safe to resume from: step {safe}" if safe is not None else "no intact checkpoint to resume from")
