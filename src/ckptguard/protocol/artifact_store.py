"""Storing a rank's artifacts (``files=``) into a save's attempt directory, from their paths or a snapshot.

Every regular file is copied and hashed on the way; a directory holding what a restore could not
give back (a FIFO, a socket, a symlink to a directory) is refused before anything is written.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ckptguard.checksum import Hasher
from ckptguard.errors import CheckpointError
from ckptguard.protocol import layout
from ckptguard.protocol.artifact_targets import ArtifactTarget, file_kind
from ckptguard.protocol.manifest import Artifact, FileEntry
from ckptguard.storage import StorageBackend
from ckptguard.storage.fileio import (
    open_owned,
)

#: The copy buffer.
_CHUNK = 8 << 20


def _store_file(storage: StorageBackend, src: str | bytes, dst: str, algorithm: str) -> tuple[int, str]:
    """Copy a local file (or bytes already read) into the checkpoint, hashing on the way."""
    hasher = Hasher(algorithm)
    stream = storage.open_new(dst)
    try:
        if isinstance(src, bytes):
            hasher.update(src)
            stream.write([memoryview(src)])
            size = len(src)
        else:
            size = 0
            view = memoryview(bytearray(_CHUNK))
            fin = open_owned(src, os.O_RDONLY | os.O_CLOEXEC)
            try:
                while n := os.readv(fin.fileno(), [view]):
                    hasher.update(view[:n])
                    stream.write([view[:n]])
                    size += n
            finally:
                fin.close()
        stream.sync()
    finally:
        stream.close()
    return size, hasher.hexdigest()


def _walk_files(root: str) -> list[str]:
    """The regular files under ``root``, relative; refused where it holds anything a restore could not
    give back (a FIFO, socket or device; a symlink to a directory, which os.walk does not enter; a
    symlink to nothing): skipping them silently stored less than the directory held."""
    rels, odd = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                odd.append(f"{os.path.join(dirpath, name)} (a symlink to a directory)")
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            try:
                mode = os.stat(full).st_mode
            except FileNotFoundError:
                odd.append(f"{full} (a symlink to nothing)")
                continue
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if not stat.S_ISREG(mode):
                odd.append(f"{full} (a {file_kind(mode)})")
            elif (why := _unstorable_name(rel)) is not None:
                odd.append(f"{full!r} ({why})")
            else:
                rels.append(rel)
    if odd:
        raise CheckpointError(
            f"files= directory {root} holds what ckptguard cannot store: {', '.join(odd[:5])}"
            f"{f' and {len(odd) - 5} more' if len(odd) > 5 else ''}. Remove them or name the directories of "
            "regular files that hold the data; nothing was written.",
            path=root,
        )
    return rels


@dataclass(frozen=True)
class FileSnapshot:
    """A rank's artifact read into memory (for saves that return before they are written)."""

    target: ArtifactTarget
    kind: str
    files: tuple[tuple[str, bytes], ...]  # (path relative to the artifact, contents)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for _, b in self.files)


def _unstorable_name(rel: str) -> str | None:
    """Why a manifest could not name ``rel`` (every load refuses a manifest that does), or None."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return "a name that is not UTF-8"
    if "\\" in rel:
        return "a name with a backslash"
    return None


def _sources(t: ArtifactTarget) -> tuple[str, list[tuple[str, str]]]:
    if os.path.isdir(t.path):
        return "dir", [(rel, os.path.join(t.path, rel)) for rel in _walk_files(t.path)]
    name = os.path.basename(t.path)
    if (why := _unstorable_name(name)) is not None:
        raise CheckpointError(
            f"rank {t.rank}: files[{t.key!r}] = {t.path!r} has {why}, which no load of the "
            "checkpoint would accept: rename it; nothing was written.",
            rank=t.rank,
            path=t.path,
        )
    return "file", [(name, t.path)]


def snapshot_files(targets: list[ArtifactTarget]) -> list[FileSnapshot]:
    out = []
    for t in targets:
        kind, sources = _sources(t)
        contents = []
        for rel, src in sources:
            with open(src, "rb") as f:
                contents.append((rel, f.read()))
        out.append(FileSnapshot(t, kind, tuple(contents)))
    return out


def store(
    storage: StorageBackend, items: list[ArtifactTarget] | list[FileSnapshot], staging_dir: str, algorithm: str
) -> tuple[list[Artifact], list[FileEntry]]:
    """Copy this rank's artifacts (from their paths, or from a snapshot) into the attempt directory."""
    artifacts, entries = [], []
    for it in items:
        t = it.target if isinstance(it, FileSnapshot) else it
        prefix = layout.artifact_prefix(t.rank, t.key)
        if isinstance(it, FileSnapshot):
            kind = it.kind
            sources: list[tuple[str, str | bytes]] = list(it.files)
        else:
            kind, paths = _sources(t)
            sources = list(paths)
        pairs = []
        made: set[str] = set()
        for rel, src in sources:
            stored = f"{prefix}/{rel}"
            dst = os.path.join(staging_dir, stored)
            parent = os.path.dirname(dst)
            if parent not in made:
                storage.makedirs(parent, within=staging_dir)
                made.add(parent)
            size, digest = _store_file(storage, src, dst, algorithm)
            entries.append(FileEntry(stored, size, t.rank, digest))
            pairs.append((rel, stored))
        for d in sorted(made, key=len, reverse=True):
            storage.sync_dir(d)
        storage.makedirs(os.path.join(staging_dir, prefix), within=staging_dir)
        artifacts.append(Artifact(t.rank, t.key, kind, tuple(pairs)))
    return artifacts, entries
