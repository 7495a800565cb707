"""A small filesystem that fills up: a size-limited tmpfs mounted in a temp dir.

Why: a checkpoint save that hits ENOSPC halfway must fail cleanly and leave the previous
checkpoint intact (the invariant *two-phase commit*, docs/protocol.md). A tmpfs of a few MiB reaches ENOSPC after a few
writes, is fast and needs no loop device. Needs root (or CAP_SYS_ADMIN); where mounting
is not permitted the bed is unavailable and tests skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .sshfs import BedUnavailable


def _umount(mp: Path) -> None:
    if os.path.ismount(mp) and subprocess.run(["umount", str(mp)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mp)], capture_output=True)


@contextlib.contextmanager
def small_filesystem(size: str = "8m", *, base: Path | None = None) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount -o size=`` syntax, e.g. ``"8m"``) and yield it.

    Raises :class:`BedUnavailable` if mounting is not permitted here. Unmounted on exit.
    """
    mp = Path(tempfile.mkdtemp(prefix="ckptguard-diskfull-", dir=base))
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(mp)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not os.path.ismount(mp):
            raise BedUnavailable(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        yield mp
    finally:
        _umount(mp)
        if not os.path.ismount(mp):
            shutil.rmtree(mp, ignore_errors=True)
