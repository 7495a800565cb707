"""What the fuzz tests share: a small real root, the CLI in-process, DCP directories to import."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from ckptguard import Checkpointer
from ckptguard.cli import _register, app


def cli(*args: str) -> tuple[int, str]:
    """A command's exit code and output; an exception escaping it fails the test."""
    _register()
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def save_two_steps(root: Path, cfg: Path) -> Path:
    """Step 1 (``w`` = 0..7) and step 2 (``w`` = 1..8, and a file artifact ``cfg``)."""
    cfg.write_text("lr: 0.1\n")
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.arange(8.0)}, files={"cfg": str(cfg)})
        ck.save(2, {"w": torch.arange(8.0) + 1}, files={"cfg": str(cfg)})
    return root


def dcp_dir(path: Path, n: int = 4) -> Path:
    """A directory torch.distributed.checkpoint saved: ``w`` = 0..n-1."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    dcp_save({"w": torch.arange(float(n))}, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return path


def import_dir(source: Path, root: Path) -> tuple[int, str]:
    return cli("import", str(source), str(root), "--step", "1")
