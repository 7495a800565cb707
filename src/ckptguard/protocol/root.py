"""The control plane of one checkpoint root: the :class:`Root` protocol, and :func:`open_root`, which picks
the root for a URL's scheme once.

Everything the commit protocol, ``verify`` and the Checkpointer do to a root's
control records (listing, manifests, the commit point, `latest`, retirement,
fencing) goes through a ``Root``; none of them knows which backend is under it.
Two roots implement it, each complete on its own:

    PosixRoot        (protocol/posixroot.py)  commit by renaming the attempt directory
    ObjectStoreRoot  (protocol/objstore.py)   commit by a conditional create; a CAS'd index

What they share is in protocol/rootkit.py: functions, and ``RootKit``, the methods that are the
same word for word (neither root overrides any). A new backend implements ``Root`` (or reuses one
of the two with its StorageBackend), adds one line to ``_ROOTS``, and passes
tests/storage/test_root_conformance.py (the Architecture page, "Adding a backend").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

from ckptguard.comm import Comm
from ckptguard.protocol.decisions import DomainListing
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import FileEntry, Manifest
from ckptguard.protocol.objstore import ObjectStoreRoot
from ckptguard.protocol.posixroot import PosixRoot
from ckptguard.protocol.quarantine import QuarantineRecord
from ckptguard.protocol.records import LatestRecord
from ckptguard.protocol.rootkit import Garbage
from ckptguard.protocol.topology import Topology
from ckptguard.storage import StorageBackend, backend_for, open_storage

__all__ = ["Garbage", "ObjectStoreRoot", "PosixRoot", "Root", "open_root"]


class Root(Protocol):
    """One checkpoint root as this rank sees it. Only domain leaders list and change it; every change
    to shared state checks the fence (:meth:`guard`) immediately before it acts."""

    storage: StorageBackend
    #: the checksum algorithm a save records when the caller names none
    default_checksum: str

    # -- where things are
    @property
    def path(self) -> str: ...

    def location(self) -> Literal["ok", "missing", "not a directory"]:
        """Whether the root can hold checkpoints as given ("missing": nothing there yet)."""

    def local_dir(self) -> str | None:
        """The root's real path on this machine's filesystem (None: it is not on one)."""

    def dir(self, name: CheckpointName) -> str:
        """Where a committed checkpoint's manifest is (its directory, or its key prefix)."""

    def staging_dir(self, step: int, attempt: str) -> str: ...

    def data_dir(self, name: CheckpointName, manifest: Manifest) -> str:
        """Where the files of a committed checkpoint are."""

    def probe_domains(self, comm: Comm, *, write: bool) -> Topology:
        """Which ranks share this root (collective)."""

    # -- the fence
    def set_fence(self, fence: Callable[[str], None]) -> None: ...

    def guard(self, acting: str) -> None:
        """Raise LeaseLostError unless this job still holds the root."""

    def fence_staging(self) -> None:
        """Runs before the lease is taken: make a stalled previous holder's commit fail."""

    def after_lease(self) -> None:
        """Runs once the lease is taken: fence older jobs out, settle what they left pending."""

    # -- reading
    def committed(self) -> list[CheckpointName]:
        """Every committed checkpoint (all versions), oldest first."""

    def current(self) -> dict[int, CheckpointName]:
        """The newest committed version of each step."""

    def listing(self) -> DomainListing:
        """step -> {version: commit sequence number} of every committed checkpoint."""

    def still_committed(self, name: CheckpointName, seq: int | None) -> bool: ...

    def taken_versions(self, step: int) -> list[int]:
        """Versions of ``step`` a new save must not reuse beyond those listed."""

    def latest_seq(self) -> int:
        """The highest commit sequence number ever handed out here (0: none)."""

    def read_latest(self) -> LatestRecord | None: ...

    def latest_problem(self) -> str | None:
        """Why `latest` cannot be read (None: it can, or there is none)."""

    def read_manifest(self, name: CheckpointName) -> Manifest: ...

    def read_manifest_bytes(self, name: CheckpointName) -> bytes: ...

    def parse_manifest(
        self, name: CheckpointName, data: bytes, seq: int | None = None, part: tuple[int, int] = (0, 1)
    ) -> Manifest:
        """Parse and check a manifest's bytes. ``part`` (k, n): of the checks that relate its DCP
        entries to its item rows, only the names k, k + n, ... (n ranks holding the same bytes share
        them; the caller agrees on the outcome)."""

    def check_files(self, name: CheckpointName, manifest: Manifest, part: tuple[int, int] = (0, 1)) -> None:
        """Every file of a checkpoint present with its recorded size; CorruptCheckpointError if not.
        ``part`` (k, n): only the files k, k + n, k + 2n, ... (n readers share the lookups)."""

    def walk(self, path: str) -> list[tuple[str, int]]:
        """(relative path, size or rootkit.NOT_A_FILE) of every entry under ``path``."""

    def quarantined(self) -> dict[CheckpointName, QuarantineRecord]:
        """The quarantine records of this root (protocol/quarantine.py): checkpoints loads found corrupt.
        A record applies to a commit only where its sequence number matches (``QuarantineRecord.matches``)."""

    def garbage(self, keep_attempts: frozenset[str] = frozenset(), min_probe_age_s: float = 600.0) -> Garbage: ...

    def unlisted_commits(self) -> dict[CheckpointName, str]:
        """Commit objects the root's record of commits does not list, with the attempt each names (an
        object store's manifest at a step's key that its index does not hold): a damaged root, or a
        retention caught between its two deletes. Their data is never garbage; ``ls``/``verify`` name them."""

    # -- writing (leaders, under the lease)
    def make_staging(self, step: int, attempt: str) -> str: ...

    def wait_files_visible(self, base: str, files: list[FileEntry], timeout: float) -> None: ...

    def commit(self, staging: str, manifest: Manifest, last_check: Callable[[], None]) -> CheckpointName:
        """Make the attempt ``staging`` the checkpoint ``manifest`` describes, atomically; ``last_check``
        runs immediately before the commit point and stops the commit by raising."""

    def move_latest(self, name: CheckpointName, seq: int | None) -> bool: ...

    def latest_after_delete(self, deleted: int, left: DomainListing) -> None: ...

    def retire(self, path: str) -> str | None:
        """Take a checkpoint or leftover out of sight atomically; what to remove later (None: nothing)."""

    def invalidate(self, path: str) -> None: ...

    def remove_retired(self, path: str) -> None: ...

    def quarantine(self, name: CheckpointName, seq: int | None, reason: str) -> None:
        """Record that the commit ``name``, listed with ``seq``, is corrupt (under the fence)."""

    def release_quarantine(self, name: CheckpointName) -> None:
        """Remove the quarantine record of ``name``, if any (under the fence)."""

    def prune_quarantine(self, listing: DomainListing) -> None:
        """Remove every quarantine record that names no commit of ``listing`` (under the fence)."""

    def discard_attempt(self, staging: str, name: CheckpointName, attempt: str) -> None:
        """Remove a failed save's data, unless it may be committed after all."""


#: The root of each kind of backend (``Backend.filesystem`` in :data:`ckptguard.storage.BACKENDS`): a
#: filesystem with an atomic no-replace rename, or an object store with conditional writes. A backend
#: that is neither has a ``Root`` of its own in ``_ROOTS_BY_SCHEME``.
_ROOTS: dict[bool, Callable[[StorageBackend], Root]] = {True: PosixRoot, False: ObjectStoreRoot}
_ROOTS_BY_SCHEME: dict[str, Callable[[StorageBackend], Root]] = {}


def open_root(root: str | os.PathLike[str] | StorageBackend, options: Mapping[str, Any] | None = None) -> Root:
    """The root for a directory or URL (or a backend already opened for one), chosen by its scheme."""
    storage = open_storage(root, options) if isinstance(root, (str, os.PathLike)) else root
    backend = backend_for(storage.root)
    return _ROOTS_BY_SCHEME.get(backend.scheme, _ROOTS[backend.filesystem])(storage)
