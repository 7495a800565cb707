"""Restoring a rank's artifacts (``files=``) on load: staged verified next to their destinations, then swapped in.

Nothing a user sees changes until every rank has staged its copies; a load that fails after the
swap moves the user's files back (``swap_back``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptguard._signals import signals_deferred
from ckptguard.checksum import Hasher
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.protocol.artifact_targets import ArtifactTarget, remove_quietly
from ckptguard.protocol.manifest import FileEntry, Manifest
from ckptguard.storage import StorageBackend
from ckptguard.storage.fileio import (
    fsync_dir,
    makedirs_durable,
    open_owned,
    rmtree_off_main_thread,
    unique_tmp_name,
    write_all,
)

#: The copy buffer.
_CHUNK = 8 << 20


def _restore_file(storage: StorageBackend, src: str, dst: str, expect: FileEntry, algorithm: str) -> None:
    """Copy a stored file out of the checkpoint to a new local file, checking size and checksum."""
    handle = storage.open_read(src)
    try:
        size = handle.size()
        if size != expect.size:
            raise CorruptCheckpointError(
                f"{src}: {size} bytes, the manifest says {expect.size}. The checkpoint is corrupt.", path=src
            )
        hasher = Hasher(algorithm)
        view = memoryview(bytearray(min(_CHUNK, max(size, 1))))
        out = open_owned(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, "create")
        fout = out.fileno()
        try:
            pos = 0
            while pos < size:
                part = view[: min(len(view), size - pos)]
                handle.read_into([part], pos)
                hasher.update(part)
                write_all(fout, [part])
                pos += len(part)
            os.fsync(fout)
        finally:
            out.close()
    finally:
        handle.close()
    digest = hasher.hexdigest()
    if digest != expect.checksum:
        raise CorruptCheckpointError(
            f"{src}: checksum {digest}, the manifest says {expect.checksum}. The checkpoint is corrupt.", path=src
        )


@dataclass
class RestoreSwap:
    """One artifact being restored: its verified copy next to its destination, and what it displaced."""

    staged: str
    dest: str
    is_dir: bool
    displaced: str | None = None  # what stood at ``dest`` before: kept until the load has committed
    swapped: bool = False


def stage_restore(
    storage: StorageBackend, targets: list[ArtifactTarget], manifest: Manifest, checkpoint_dir: str
) -> list[RestoreSwap]:
    """Copy this rank's artifacts next to their destinations, verified; nothing a user sees changes yet.

    A directory artifact is restored whole into a sibling directory, which later
    replaces the destination, so the restored directory holds exactly what was
    saved (no file of another checkpoint left beside it); a corrupt artifact,
    on this rank or any other, changes nothing before load falls back.
    """
    swaps: list[RestoreSwap] = []
    try:
        sums = {f.path: f for f in manifest.files}
        for t in targets:
            art = manifest.artifact(t.rank, t.key)
            if art is None:
                keys = sorted({a.key for a in manifest.artifacts if a.rank == t.rank})
                raise CheckpointError(
                    f"rank {t.rank}: the checkpoint holds no artifact {t.key!r} for this rank "
                    f"(it has {keys or 'none'})",
                    rank=t.rank,
                )
            makedirs_durable(os.path.dirname(t.path) or ".")
            swap = RestoreSwap(unique_tmp_name(t.path), t.path, art.kind == "dir")
            swaps.append(swap)
            if swap.is_dir:
                os.mkdir(swap.staged)
                made = {swap.staged}
                for rel, stored in art.files:
                    dst = os.path.join(swap.staged, rel)
                    parent = os.path.dirname(dst)
                    if parent not in made:
                        makedirs_durable(parent)
                        made.add(parent)
                    _restore_file(
                        storage, os.path.join(checkpoint_dir, stored), dst, sums[stored], manifest.checksum_algorithm
                    )
                for d in sorted(made, key=len, reverse=True):
                    fsync_dir(d)
            else:
                for _, stored in art.files:
                    _restore_file(
                        storage,
                        os.path.join(checkpoint_dir, stored),
                        swap.staged,
                        sums[stored],
                        manifest.checksum_algorithm,
                    )
    except BaseException:
        abort_restore(swaps)
        raise
    return swaps


def swap_in(swaps: list[RestoreSwap]) -> None:
    """Move every restored copy into place; what stood there is moved aside, not deleted. A Ctrl-C
    is held back meanwhile: what each swap did is recorded before swap_back reads it."""
    with signals_deferred():
        for s in swaps:
            if os.path.lexists(s.dest):
                displaced = unique_tmp_name(s.dest) + ".displaced"
                os.rename(s.dest, displaced)
                s.displaced = displaced  # recorded once done: swap_back moves back only what moved
            os.rename(s.staged, s.dest)
            s.swapped = True
    for d in sorted({os.path.dirname(s.dest) or "." for s in swaps}):
        fsync_dir(d)


def swap_back(swaps: list[RestoreSwap]) -> None:
    """Undo swap_in (this or another rank failed before the state changed): the user's files are back
    as they were, the staged copies removed."""
    with signals_deferred():
        for s in reversed(swaps):
            if s.swapped:
                os.rename(s.dest, s.staged)
                s.swapped = False
            if s.displaced is not None:
                os.rename(s.displaced, s.dest)
                s.displaced = None
    abort_restore(swaps)


def finish_restore(swaps: list[RestoreSwap]) -> None:
    """The load committed: remove what the restored artifacts displaced."""
    for s in swaps:
        if s.displaced is not None:
            _remove_any(s.displaced)
            s.displaced = None


def abort_restore(swaps: list[RestoreSwap]) -> None:
    for s in swaps:
        if not s.swapped:
            _remove_any(s.staged)


def _remove_any(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        rmtree_off_main_thread(path, ignore_errors=True)
    else:
        remove_quietly(path)
