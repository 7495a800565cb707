"""`ckptguard export` and `ckptguard import`: ckptguard checkpoints to and from other formats.

Exit codes: 0 done, 1 the checkpoint or source is corrupt or unsafe, 2 usage errors.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ckptguard.cli import app, fail
from ckptguard.cli.output import console, say


def _fail(message: str, code: int) -> typer.Exit:
    return fail(message, code)


@app.command("export")
def export_command(
    root: Annotated[str, typer.Argument(help="A checkpoint root, or one committed step's directory.")],
    out: Annotated[str, typer.Argument(help="The file (torch, safetensors) or new directory (dcp) to write.")],
    to: Annotated[str, typer.Option("--to", help="torch | safetensors | dcp")] = "torch",
    step: Annotated[int | None, typer.Option("--step", help="The step (default: the newest committed).")] = None,
    key: Annotated[str | None, typer.Option("--key", help="Export one entry of the state, e.g. model.")] = None,
) -> None:
    """Write one committed step as a torch.save file, a .safetensors file or a plain DCP directory."""
    from ckptguard.errors import (
        CheckpointError,
        CorruptCheckpointError,
        StepNotFoundError,
        UnsafeObjectError,
    )

    try:
        skipped = _export(root, out, to, step, key)
    except KeyError as e:
        raise _fail(str(e.args[0]) if e.args else str(e), 2) from None
    except (ValueError, StepNotFoundError) as e:
        raise _fail(str(e), 2) from None
    except (CorruptCheckpointError, UnsafeObjectError) as e:
        raise _fail(str(e), 1) from None
    except CheckpointError as e:
        raise _fail(str(e), 2) from None
    if skipped:
        say(
            console(stderr=True),
            f"left out {len(skipped)} non-tensor value(s) safetensors cannot hold: "
            f"{', '.join(skipped[:8])}{' ...' if len(skipped) > 8 else ''}",
        )
    say(console(), f"exported {root} to {out} ({to})")


#: How often `export` without --step takes the newest step again when the job's retention retired the one
#: it was reading (a job saving faster than one export reads retires each newest step in turn).
EXPORT_TRIES = 8


def _export(root: str, out: str, to: str, step: int | None, key: str | None) -> list[str]:
    """Export ``step``, or the newest committed step: retried on the newest of the moment when the job's
    retention retires the one being read (never when a step was asked for: that one is gone)."""
    from ckptguard.errors import CheckpointError
    from ckptguard.interop import export_checkpoint, resolve_checkpoint

    if step is not None:
        return export_checkpoint(root, out, to, step=step, key=key)
    for tries_left in range(EXPORT_TRIES - 1, -1, -1):
        where, name = resolve_checkpoint(root)
        try:
            return export_checkpoint(root, out, to, step=name.step, key=key)
        except CheckpointError:
            if tries_left == 0 or where.still_committed(name, None):
                raise
            say(
                console(stderr=True),
                f"note: step {name.step} of {where.path} was retired by the job's retention "
                "while it was read; exporting the newest committed step instead",
            )
    raise AssertionError("unreachable")


@app.command("import")
def import_command(
    source: Annotated[str, typer.Argument(help="A DCP checkpoint directory or a torch.save file.")],
    root: Annotated[str, typer.Argument(help="The ckptguard checkpoint root to commit it into.")],
    step: Annotated[int, typer.Option("--step", help="The step to commit it as.")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a committed step atomically.")] = False,
) -> None:
    """Commit a DCP directory or torch.save file as a ckptguard checkpoint (no code from it runs)."""
    from ckptguard.errors import CheckpointError, CorruptCheckpointError, UnsafeObjectError
    from ckptguard.interop import import_checkpoint

    try:
        keys = import_checkpoint(source, root, step, overwrite=overwrite)
    except ValueError as e:
        raise _fail(str(e), 2) from None
    except (CorruptCheckpointError, UnsafeObjectError) as e:
        raise _fail(str(e), 1) from None
    except CheckpointError as e:
        raise _fail(str(e), 2) from None
    say(console(), f"imported {source} as step {step} of {root} (keys: {', '.join(keys)})")
