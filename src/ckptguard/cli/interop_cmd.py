"""`ckptguard export` and `ckptguard import`: ckptguard checkpoints to and from other formats.

Exit codes: 0 done, 1 the checkpoint or source is corrupt or unsafe, 2 usage errors.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ckptguard.cli import app, fail
from ckptguard.cli.output import console


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
    from ckptguard.interop import export_checkpoint

    try:
        skipped = export_checkpoint(root, out, to, step=step, key=key)
    except KeyError as e:
        raise _fail(str(e.args[0]) if e.args else str(e), 2) from None
    except (ValueError, StepNotFoundError) as e:
        raise _fail(str(e), 2) from None
    except (CorruptCheckpointError, UnsafeObjectError) as e:
        raise _fail(str(e), 1) from None
    except CheckpointError as e:
        raise _fail(str(e), 2) from None
    if skipped:
        console(stderr=True).print(f"left out {len(skipped)} non-tensor value(s) safetensors cannot hold: "
                                   f"{', '.join(skipped[:8])}{' ...' if len(skipped) > 8 else ''}", highlight=False)
    console().print(f"exported {root} to {out} ({to})", highlight=False)


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
    console().print(f"imported {source} as step {step} of {root} (keys: {', '.join(keys)})", highlight=False)
