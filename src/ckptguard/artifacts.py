"""Per-rank artifacts (``files=``): a rank's private files or directory, such as offloaded optimizer state.

Each rank's artifacts are stored under that rank's own namespace in the
checkpoint and restored to the path the rank names on load. Before any byte is
written, the paths of all ranks are checked to be disjoint: two ranks naming one
directory is the DeepSpeed ``offloaded_tensors/`` race, and is refused.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ckptguard import layout
from ckptguard.checksum import Hasher, checksum
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.manifest import Artifact, FileEntry, Manifest
from ckptguard.storage.posix import fsync_dir, unique_tmp_name, write_all, write_new_file

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ArtifactTarget:
    """One ``files=`` entry of one rank, as gathered for the disjointness check."""

    rank: int
    host: str
    key: str
    path: str  # absolute, symlinks resolved


def normalize(files: Mapping[str, str | os.PathLike[str]] | None, rank: int, host: str,
              must_exist: bool) -> list[ArtifactTarget]:
    if not files:
        return []
    out = []
    for key, p in files.items():
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise CheckpointError(f"rank {rank}: files key {key!r} must be 1-128 letters, digits, '.', '_' or '-'",
                                  rank=rank)
        path = os.path.realpath(os.fspath(p))
        if must_exist and not os.path.exists(path):
            raise CheckpointError(f"rank {rank}: files[{key!r}] = {path} does not exist", rank=rank, path=path)
        out.append(ArtifactTarget(rank, host, key, path))
    return out


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def find_collisions(targets: list[ArtifactTarget]) -> tuple[list[tuple[ArtifactTarget, ArtifactTarget]],
                                                            list[tuple[ArtifactTarget, ArtifactTarget]]]:
    """Pairs of different ranks whose paths are the same or nested.

    Returns (certain, uncertain): certain collisions are on one host; uncertain
    ones are on different hosts and collide only if that path is on shared
    storage, which the caller settles by a probe.
    """
    by_path = sorted(targets, key=lambda t: t.path)
    certain, uncertain = [], []
    # Sorted by path, nested paths are adjacent runs: compare each with its followers while they nest.
    for i, a in enumerate(by_path):
        for j in range(i + 1, len(by_path)):
            b = by_path[j]
            if not _nested(a.path, b.path):
                if not b.path.startswith(a.path):
                    break
                continue
            if a.rank == b.rank:
                if a.key != b.key:
                    certain.append((a, b))
                continue
            (certain if a.host == b.host else uncertain).append((a, b))
    return certain, uncertain


def collision_message(a: ArtifactTarget, b: ArtifactTarget) -> str:
    how = "the same path" if a.path == b.path else "nested paths"
    return (f"rank {a.rank} (files[{a.key!r}] = {a.path}) and rank {b.rank} (files[{b.key!r}] = {b.path}) "
            f"name {how}{'' if a.host != b.host else f' on host {a.host}'}: their files would overwrite each "
            "other on save and on restore. Give each rank its own directory, e.g. .../rank{RANK}; nothing "
            "was written.")


def probe_anchor(path: str) -> str:
    """The nearest existing directory at or above ``path`` (where a probe marker can be left)."""
    p = path
    while not os.path.isdir(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


# -- copy in and out ------------------------------------------------------------------------


def _copy_hashing(src: str, dst: str, algorithm: str) -> tuple[int, str]:
    hasher = Hasher(algorithm)
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    fin = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            while True:
                n = os.readv(fin, [view])
                if n == 0:
                    break
                hasher.update(view[:n])
                write_all(fout, view[:n])
                size += n
            os.fsync(fout)
        finally:
            os.close(fout)
    finally:
        os.close(fin)
    return size, hasher.hexdigest()


def _walk_files(root: str) -> list[str]:
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.isfile(full):
                rels.append(os.path.relpath(full, root).replace(os.sep, "/"))
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


def _sources(t: ArtifactTarget) -> tuple[str, list[tuple[str, str]]]:
    if os.path.isdir(t.path):
        return "dir", [(rel, os.path.join(t.path, rel)) for rel in _walk_files(t.path)]
    return "file", [(os.path.basename(t.path), t.path)]


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


def _write_bytes_hashing(data: bytes, dst: str, algorithm: str) -> tuple[int, str]:
    write_new_file(dst, data)
    return len(data), checksum(algorithm, data)


def store(items: list[ArtifactTarget] | list[FileSnapshot], staging_dir: str, algorithm: str
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
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            if isinstance(src, bytes):
                size, digest = _write_bytes_hashing(src, dst, algorithm)
            else:
                size, digest = _copy_hashing(src, dst, algorithm)
            entries.append(FileEntry(stored, size, t.rank, digest))
            pairs.append((rel, stored))
        os.makedirs(os.path.join(staging_dir, prefix), exist_ok=True)
        # os.makedirs may have created every directory from files/ down (rankNNNNN, the key, its
        # subdirectories): fsync each of them and files/ itself, so that every new entry, file or
        # directory, is durable in its parent before the commit (fsync of a child does not do it).
        files_dir = os.path.join(staging_dir, layout.FILES_DIR)
        dirs: set[str] = set()
        for d in made | {os.path.join(staging_dir, prefix)}:
            while d.startswith(files_dir) and d not in dirs:
                dirs.add(d)
                d = os.path.dirname(d)
        for d in sorted(dirs, key=len, reverse=True):
            fsync_dir(d)
        artifacts.append(Artifact(t.rank, t.key, kind, tuple(pairs)))
    return artifacts, entries


def stage_restore(targets: list[ArtifactTarget], manifest: Manifest, checkpoint_dir: str) -> list[tuple[str, str]]:
    """Copy this rank's artifacts next to their destinations as verified temp files: [(temp, destination)].

    Nothing a user sees changes yet: a corrupt artifact, on this rank or any
    other, must not leave some files of this checkpoint restored when load falls
    back to an older one. commit_restore() renames them into place once every
    rank staged its own; abort_restore() removes them.
    """
    staged: list[tuple[str, str]] = []
    try:
        sums = {f.path: f for f in manifest.files}
        for t in targets:
            art = manifest.artifact(t.rank, t.key)
            if art is None:
                keys = sorted({a.key for a in manifest.artifacts if a.rank == t.rank})
                raise CheckpointError(f"rank {t.rank}: the checkpoint holds no artifact {t.key!r} for this rank "
                                      f"(it has {keys or 'none'})", rank=t.rank)
            if art.kind == "dir":
                dests = [(os.path.join(t.path, rel), stored) for rel, stored in art.files]
            else:
                dests = [(t.path, stored) for _, stored in art.files]
            for dst, stored in dests:
                entry = sums[stored]
                src = os.path.join(checkpoint_dir, stored)
                os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
                tmp = unique_tmp_name(dst)
                staged.append((tmp, dst))
                try:
                    size, digest = _copy_hashing(src, tmp, manifest.checksum_algorithm)
                except FileNotFoundError:
                    raise CorruptCheckpointError(f"{src} is missing: the checkpoint is incomplete", path=src) from None
                if size != entry.size or digest != entry.checksum:
                    raise CorruptCheckpointError(
                        f"{src}: {size} bytes with checksum {digest}, the manifest says {entry.size} bytes with "
                        f"{entry.checksum}. The checkpoint is corrupt.", path=src)
    except BaseException:
        abort_restore(staged)
        raise
    return staged


def commit_restore(staged: list[tuple[str, str]]) -> None:
    for tmp, dst in staged:
        os.replace(tmp, dst)
    for d in sorted({os.path.dirname(dst) or "." for _, dst in staged}):
        fsync_dir(d)


def abort_restore(staged: list[tuple[str, str]]) -> None:
    for tmp, _ in staged:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
