"""Where each rank's artifacts (``files=``) live, and the check that no two ranks' paths collide.

Before any byte is written, the paths of all ranks are checked to be disjoint: two ranks naming one
directory is the DeepSpeed ``offloaded_tensors/`` race, and is refused. The same path on two hosts
collides only where the path is on storage both share (``probe_shared_paths`` looks).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from ckptguard.comm import Comm
from ckptguard.errors import CheckpointError, PathCollisionError, UnsupportedValueError

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


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
                    f"rank {rank}: files[{key!r}] = {path} is a {file_kind(mode)}, not a regular file or a directory: "
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


def file_kind(mode: int) -> str:
    """What a file that is neither regular nor a directory is, for a refusal."""
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
