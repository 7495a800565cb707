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
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from ckptguard._signals import signals_deferred
from ckptguard.checksum import Hasher
from ckptguard.comm import Comm
from ckptguard.errors import CheckpointError, CorruptCheckpointError, PathCollisionError, UnsupportedValueError
from ckptguard.protocol import layout
from ckptguard.protocol.manifest import Artifact, FileEntry, Manifest
from ckptguard.storage import StorageBackend
from ckptguard.storage.fileio import (
    fsync_dir,
    makedirs_durable,
    open_owned,
    rmtree_off_main_thread,
    unique_tmp_name,
    write_all,
)

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ArtifactTarget:
    """One ``files=`` entry of one rank, as gathered for the disjointness check."""

    rank: int
    host: str
    key: str
    path: str  # absolute, symlinks resolved


def normalize(
    files: Mapping[str, str | os.PathLike[str]] | None, rank: int, host: str, must_exist: bool, local_root: str | None
) -> list[ArtifactTarget]:
    """This rank's ``files=`` as absolute real paths, refused where one is, contains or lies inside the
    checkpoint root ``local_root`` (its real path; None: not on a local filesystem, so no overlap):
    restoring it would replace the root's own checkpoints (or copy them into themselves)."""
    if files is None:
        return []
    if not isinstance(files, Mapping):
        raise UnsupportedValueError(
            f"files must be a mapping of a key to a local path (files={{'offload': "
            f"'/path'}}), got {files!r} ({type(files).__name__}) on rank {rank}",
            rank=rank,
        )
    root = local_root
    out = []
    for key, p in files.items():
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise CheckpointError(
                f"rank {rank}: files key {key!r} must be 1-128 letters, digits, '.', '_' or '-'", rank=rank
            )
        if not isinstance(p, (str, os.PathLike)):
            raise UnsupportedValueError(
                f"rank {rank}: files[{key!r}] must be a local path (str or os.PathLike), "
                f"got {p!r} ({type(p).__name__})",
                rank=rank,
            )
        path = os.path.realpath(os.fspath(p))
        if root is not None and _nested(path, root):
            how = (
                "is the checkpoint root"
                if path == root
                else "contains the checkpoint root"
                if root.startswith(path.rstrip("/") + "/")
                else "lies inside the checkpoint root"
            )
            raise PathCollisionError(
                f"rank {rank}: files[{key!r}] = {path} {how} {root}: restoring it would replace the root's "
                "own checkpoints. Name a directory outside the checkpoint root (e.g. the offload directory "
                "itself, not the run directory that holds the root); nothing was written or replaced.",
                rank=rank,
                path=path,
            )
        if must_exist and not os.path.exists(path):
            raise CheckpointError(f"rank {rank}: files[{key!r}] = {path} does not exist", rank=rank, path=path)
        if must_exist:
            mode = os.stat(path).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CheckpointError(
                    f"rank {rank}: files[{key!r}] = {path} is a {_kind(mode)}, not a regular file or a directory: "
                    "ckptguard stores regular files (reading a FIFO would wait for a writer forever, a device "
                    "has no end). Name the file or directory that holds the data; nothing was written.",
                    rank=rank,
                    path=path,
                )
        out.append(ArtifactTarget(rank, host, key, path))
    return out


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def find_collisions(
    targets: list[ArtifactTarget],
) -> tuple[list[tuple[ArtifactTarget, ArtifactTarget]], list[tuple[ArtifactTarget, ArtifactTarget]]]:
    """Pairs of different ranks whose paths are the same or nested.

    Returns (certain, uncertain): certain collisions are on one host; uncertain
    ones are on different hosts and collide only if that path is on shared
    storage, which the caller settles by a probe.
    """
    by_path = sorted(targets, key=lambda t: t.path)
    certain: list[tuple[ArtifactTarget, ArtifactTarget]] = []
    uncertain: list[tuple[ArtifactTarget, ArtifactTarget]] = []
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


def collision_error(
    a: ArtifactTarget, b: ArtifactTarget, where: str = "on save and on restore", note: str = ""
) -> PathCollisionError:
    return PathCollisionError(collision_message(a, b, where) + note, rank=a.rank, path=a.path)


def collision_message(a: ArtifactTarget, b: ArtifactTarget, where: str = "on save and on restore") -> str:
    how = "the same path" if a.path == b.path else "nested paths"
    return (
        f"rank {a.rank} (files[{a.key!r}] = {a.path}) and rank {b.rank} (files[{b.key!r}] = {b.path}) "
        f"name {how}{'' if a.host != b.host else f' on host {a.host}'}: their files would overwrite each "
        f"other {where}. Give each rank its own directory, e.g. .../rank{{RANK}}; nothing "
        "was written."
    )


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


def _kind(mode: int) -> str:
    return (
        "FIFO"
        if stat.S_ISFIFO(mode)
        else "socket"
        if stat.S_ISSOCK(mode)
        else "character device"
        if stat.S_ISCHR(mode)
        else "block device"
        if stat.S_ISBLK(mode)
        else "special file"
    )


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
                odd.append(f"{full} (a {_kind(mode)})")
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


def remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def probe_shared_paths(
    comm: Comm, pairs: list[tuple[ArtifactTarget, ArtifactTarget]], nonce: str, where: str = "on save and on restore"
) -> None:
    """Same path on different hosts: a collision only if the path is on shared storage. Look.

    The first rank of each pair leaves a marker next to the path; the second
    looks for it; a marker seen is a collision (PathCollisionError on every rank).
    """
    markers: list[str] = []

    def marker_of(a: ArtifactTarget) -> str:
        return os.path.join(probe_anchor(a.path), f".ckptguard-probe-{nonce}-{a.rank}")

    def leave_markers() -> None:
        for a, _ in pairs:
            if a.rank == comm.rank:
                marker = marker_of(a)
                if not os.path.exists(marker):
                    with open(marker, "x") as f:
                        f.write(nonce)
                markers.append(marker)

    def seen_markers() -> list[tuple[ArtifactTarget, ArtifactTarget]]:
        return [(a, b) for a, b in pairs if b.rank == comm.rank and os.path.exists(marker_of(a))]

    def decide(seen: list[list[tuple[ArtifactTarget, ArtifactTarget]]]) -> None:
        collisions = [p for s in seen for p in s]
        if collisions:
            raise collision_error(*collisions[0], where=where, note=" (the path is on storage both hosts share)")

    try:
        comm.step("leave a probe marker next to its files= path", leave_markers)
        comm.step("look for the other hosts' probe markers", seen_markers, decide)
    finally:
        for m in markers:
            remove_quietly(m)
