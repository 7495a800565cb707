"""What the two roots share: plain functions over a storage backend, and :class:`RootKit`.

:class:`~ckptguard.protocol.posixroot.PosixRoot` and
:class:`~ckptguard.protocol.objstore.ObjectStoreRoot` each call the functions where their
behaviour is the same (manifests, old probes, walking a directory), and both take from
:class:`RootKit` the methods that are the same word for word. ``RootKit`` holds only
methods neither root overrides: what differs is written in each root, never overridden.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ckptguard._pool import ExitSafePool
from ckptguard.errors import CorruptCheckpointError
from ckptguard.protocol import latest, layout, quarantine
from ckptguard.protocol.decisions import DomainListing
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import HEAD_BYTES, FileEntry, Manifest, commit_seq_from_head
from ckptguard.protocol.quarantine import QuarantineRecord
from ckptguard.protocol.records import LatestRecord
from ckptguard.storage import StorageBackend

#: The size :func:`walk` reports for an entry that is neither a regular file nor a directory it follows.
NOT_A_FILE = -1
#: A checkpoint directory is 3 levels deep (files/rankNNNNN/key/...) plus what a files= artifact holds.
MAX_WALK_DEPTH = 64


@dataclass(frozen=True)
class Garbage:
    """Leftovers a crash can leave: attempts never published, checkpoints half-deleted, old probes.

    (Versions of a step that are not the one every domain agrees on are found from the
    agreed listing: :func:`ckptguard.protocol.decisions.stray_versions`.)
    """

    staging: list[str]
    trash: list[str]
    probes: list[str]


class Fence:
    """Whether this job still holds the root: ``check(acting)`` raises LeaseLostError once it does not.

    Set by the session once the lease is taken; a root without one is a tool's, or a reader's.
    """

    def __init__(self) -> None:
        self._check: Callable[[str], None] | None = None

    def set(self, check: Callable[[str], None]) -> None:
        self._check = check

    @property
    def held(self) -> bool:
        """Whether this root is a writing job's (its lease taken)."""
        return self._check is not None

    def check(self, acting: str) -> None:
        if self._check is not None:
            self._check(acting)


class _Root(Protocol):
    """What :class:`RootKit`'s methods use of the root they are part of."""

    storage: StorageBackend
    _quarantine: dict[CheckpointName, QuarantineRecord] | None

    def guard(self, acting: str) -> None: ...

    def committed(self) -> list[CheckpointName]: ...

    def parse_manifest(
        self, name: CheckpointName, data: bytes, seq: int | None = None, part: tuple[int, int] = (0, 1)
    ) -> Manifest: ...

    def read_manifest_bytes(self, name: CheckpointName) -> bytes: ...

    def retire(self, path: str) -> str | None: ...

    def quarantined(self) -> dict[CheckpointName, QuarantineRecord]: ...

    def release_quarantine(self, name: CheckpointName) -> None: ...

    def remove_retired(self, path: str) -> None: ...


class RootKit:
    """The methods of a :class:`~ckptguard.protocol.root.Root` that are the same on every backend."""

    def __init__(self, storage: StorageBackend) -> None:
        self.storage = storage
        self._fence = Fence()
        # The quarantine records as the lease holder knows them: only the holder writes them (under the
        # fence), so once read it keeps them itself, and its saves and loads list nothing more.
        self._quarantine: dict[CheckpointName, QuarantineRecord] | None = None

    @property
    def path(self) -> str:
        return self.storage.root

    def dir(self, name: CheckpointName) -> str:
        return checkpoint_dir(self.storage, name)

    def staging_dir(self, step: int, attempt: str) -> str:
        return staging_dir(self.storage, step, attempt)

    def set_fence(self, fence: Callable[[str], None]) -> None:
        """``fence(acting)`` raises LeaseLostError once this job no longer holds the root."""
        self._fence.set(fence)

    def current(self: _Root) -> dict[int, CheckpointName]:
        """The newest version of each committed step (tools; the protocol agrees on versions across
        storage domains with ``listing``)."""
        return layout.newest_versions(self.committed())

    def read_latest(self) -> LatestRecord | None:
        return latest.read(self.storage)

    def latest_problem(self) -> str | None:
        return latest.problem(self.storage)

    def read_manifest(self: _Root, name: CheckpointName) -> Manifest:
        return self.parse_manifest(name, self.read_manifest_bytes(name))

    def read_manifest_bytes(self, name: CheckpointName) -> bytes:
        return read_manifest_bytes(self.storage, name)

    def invalidate(self: _Root, path: str) -> None:
        """Delete a checkpoint or leftover: first take it out of sight (``retire``), then remove it."""
        retired = self.retire(path)
        if retired is not None:
            self.remove_retired(retired)

    def remove_retired(self: _Root, path: str) -> None:
        """Remove what ``retire`` took out of sight (under the fence)."""
        self.guard(f"remove {path}")
        self.storage.remove_tree(path)

    def quarantined(self) -> dict[CheckpointName, QuarantineRecord]:
        """The checkpoints loads found corrupt (protocol/quarantine.py), whatever is committed now: read
        each time by a reader, once by the lease holder (it writes them itself from then on)."""
        if self._quarantine is not None:
            return dict(self._quarantine)
        found = quarantine.read_all(self.storage)
        if self._fence.held:
            self._quarantine = found
        return dict(found)

    def quarantine(self: _Root, name: CheckpointName, seq: int | None, reason: str) -> None:
        """Record that the commit ``name`` (listed with ``seq``) is corrupt (under the fence)."""
        record = quarantine.write(
            self.storage, name, seq, reason, fence=lambda: self.guard(f"quarantine {name.dirname}")
        )
        if self._quarantine is not None:
            self._quarantine[name] = record

    def release_quarantine(self: _Root, name: CheckpointName) -> None:
        """Remove the quarantine record of ``name``, if any (under the fence)."""
        quarantine.remove(
            self.storage, name, fence=lambda: self.guard(f"remove the quarantine record of {name.dirname}")
        )
        if self._quarantine is not None:
            self._quarantine.pop(name, None)

    def prune_quarantine(self: _Root, listing: DomainListing) -> None:
        """Remove every quarantine record naming no commit of ``listing`` (retired, deleted or replaced)."""
        for name, record in self.quarantined().items():
            if name.version not in listing.get(name.step, {}) or not record.matches(listing[name.step][name.version]):
                self.release_quarantine(name)


def relative(path: str, base: str) -> str | None:
    """``path`` relative to ``base``, None if it is not under it (URLs are not normalised as os.path would)."""
    return path[len(base) + 1 :] if path.startswith(base.rstrip("/") + "/") else None


def checkpoint_dir(storage: StorageBackend, name: CheckpointName) -> str:
    return storage.path(name.dirname)


def staging_dir(storage: StorageBackend, step: int, attempt: str) -> str:
    return storage.path(layout.STAGING, layout.staging_dirname(step, attempt))


def manifest_path(storage: StorageBackend, name: CheckpointName) -> str:
    return os.path.join(checkpoint_dir(storage, name), layout.MANIFEST)


def read_manifest_bytes(storage: StorageBackend, name: CheckpointName) -> bytes:
    path = manifest_path(storage, name)
    try:
        return storage.read_bytes(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing", path=path) from None


def parse_manifest(
    storage: StorageBackend, name: CheckpointName, data: bytes, seq: int | None = None, part: tuple[int, int] = (0, 1)
) -> Manifest:
    """Parse and check a manifest; ``seq``: the commit sequence number it was listed with; ``part``:
    as in ``Root.parse_manifest``."""
    path = manifest_path(storage, name)
    m = Manifest.from_json(data, path, part)
    if m.step != name.step or m.version != name.version:
        raise CorruptCheckpointError(
            f"{path} describes step {m.step} v{m.version} but sits in {name.dirname}: "
            "the directory was renamed or copied by hand",
            path=path,
        )
    if m.commit_seq is None:
        raise CorruptCheckpointError(
            f"{path} records no commit sequence number (body.commit_seq; every ckptguard commit records one): "
            "the manifest was edited or damaged",
            path=path,
        )
    if seq is not None and m.commit_seq != seq:
        raise CorruptCheckpointError(
            f"{path} records commit sequence number {m.commit_seq}, its head said {seq}: the manifest is corrupt",
            path=path,
        )
    return m


def commit_seq(storage: StorageBackend, name: CheckpointName) -> tuple[bool, int | None]:
    """(committed?, its commit sequence number) from the head of its manifest.

    A manifest whose head holds no sequence number (a damaged head) is read whole;
    one that does not parse still counts as committed (a load will report it
    corrupt), without a sequence number.
    """
    path = manifest_path(storage, name)
    try:
        handle = storage.open_read(path)
    except CorruptCheckpointError:  # missing (not committed), or not a regular file
        return storage.exists(path), None
    try:
        head = bytearray(min(HEAD_BYTES, handle.size()))
        handle.read_into([memoryview(head)], 0)
    finally:
        handle.close()
    seq = commit_seq_from_head(bytes(head))
    if seq is None:
        try:
            seq = parse_manifest(storage, name, read_manifest_bytes(storage, name)).commit_seq
        except CorruptCheckpointError:
            seq = None
    return True, seq


def still_committed(storage: StorageBackend, name: CheckpointName, seq: int | None) -> bool:
    """Whether ``name`` is still the checkpoint that was listed with commit sequence number ``seq``.

    False when it was retired, and also when it was retired and saved again
    under the same name (a step deleted and saved anew): a reader holding the
    old manifest must list again, not call the new one corrupt.
    """
    found, now = commit_seq(storage, name)
    return found and (seq is None or now is None or now == seq)


def old_probes(storage: StorageBackend, min_age_s: float) -> list[str]:
    """Storage-domain probes older than ``min_age_s`` (a probe in use is seconds old)."""
    probes = []
    now = time.time()
    for entry in storage.listdir(storage.path(layout.PROBE)):
        p = storage.path(layout.PROBE, entry)
        mtime = storage.mtime(p)
        if mtime is not None and now - mtime > min_age_s:
            probes.append(p)
    return probes


def walk(
    storage: StorageBackend, path: str, follow: Callable[[str], bool], rel: str = "", depth: int = 0
) -> list[tuple[str, int]]:
    """(path relative to ``path``, size or NOT_A_FILE) of every entry under ``path``.

    ``follow(full_path)`` says whether an entry that is not a file may be descended into (a
    symbolic link to a directory is not: a loop would never end, a link elsewhere would list
    files outside the root); the walk stops at MAX_WALK_DEPTH levels.
    """
    out: list[tuple[str, int]] = [(f"{rel}{name}", size) for name, size in storage.sizes_in(path).items()]
    files = {n for n, _ in out}
    for name in storage.listdir(path):
        if f"{rel}{name}" in files:
            continue
        full = os.path.join(path, name)
        if depth >= MAX_WALK_DEPTH or not follow(full):
            out.append((f"{rel}{name}", NOT_A_FILE))
        else:
            out.extend(walk(storage, full, follow, f"{rel}{name}/", depth + 1))
    return out


_HEAD_THREADS = 16


def head_all(storage: StorageBackend, base: str, files: list[FileEntry]) -> list[tuple[FileEntry, int | None]]:
    """Each file's size by a HEAD (consistent where a listing may be stale), in parallel; None: absent."""
    if not files:
        return []
    with ExitSafePool(min(_HEAD_THREADS, len(files)), thread_name_prefix="ckptguard-head") as pool:
        sizes = list(pool.map(lambda f: storage.size(storage.join(base, f.path)), files))
    return list(zip(files, sizes, strict=True))
