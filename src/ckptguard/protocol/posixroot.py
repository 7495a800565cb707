"""A checkpoint root on a filesystem (local disk, NFS, Lustre, FUSE): commit by renaming a directory.

    .ckptguard/staging/step-N.<attempt>/   every rank's files, then MANIFEST.json
    step-0000000N/                         the attempt renamed into place: the commit point
    latest                                 moved by compare-and-swap, never backwards

A listing is the catalog (a directory is committed once its manifest is in it);
the fence is the lease, and moving the staging directory away before taking it
(a stalled job's rename then finds no source), and removing the `latest` and tag
files a stalled job staged once it is taken (its link then finds no source).

Only domain leaders call the listing and mutating methods (one rank per storage
domain evaluates every predicate that steers control flow; the others follow
what it broadcasts).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from typing import Literal

from ckptguard.checksum import DEFAULT_ALGORITHM
from ckptguard.comm import Comm
from ckptguard.errors import CheckpointError, CorruptCheckpointError, LeaseLostError, NotVisibleError
from ckptguard.protocol import latest, layout, quarantine, rootkit
from ckptguard.protocol.decisions import DomainListing
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import FileEntry, Manifest
from ckptguard.protocol.rootkit import Garbage
from ckptguard.protocol.topology import Topology, host_domains, probe_storage_domains
from ckptguard.storage.fileio import is_tmp_name_of


class PosixRoot(rootkit.RootKit):
    """One checkpoint root on a filesystem, as this rank sees it (see the module docstring)."""

    #: checksummed by ckptguard while written (the filesystem checks nothing on arrival)
    default_checksum = DEFAULT_ALGORITHM

    # -- where things are ---------------------------------------------------------------
    def location(self) -> Literal["ok", "missing", "not a directory"]:
        if os.path.isdir(self.path):
            return "ok"
        return "not a directory" if os.path.exists(self.path) else "missing"

    def local_dir(self) -> str | None:
        """The root's real path on this machine's filesystem."""
        return os.path.realpath(self.path)

    def data_dir(self, name: CheckpointName, manifest: Manifest) -> str:
        """Where the files of a committed checkpoint are: its directory."""
        return self.dir(name)

    def probe_domains(self, comm: Comm, *, write: bool) -> Topology:
        """Which ranks share this root: by probe files when writing, by host when only reading."""
        return probe_storage_domains(comm, self.storage) if write else host_domains(comm)

    # -- the fence ----------------------------------------------------------------------
    def guard(self, acting: str) -> None:
        """Raise LeaseLostError unless this job still holds the root: called immediately before every
        change to shared state (a pointer move, a retirement, a removal), so a job that stalled while
        another took the root over changes nothing of the new holder's."""
        self._fence.check(acting)

    def fence_staging(self) -> None:
        """Move the whole staging directory away (before taking the root's lease).

        Whatever attempt a previous holder still has in flight (a stalled job, a
        frozen VM) now has no source for its publishing rename: it fails instead
        of committing into a root another job owns. Rename is atomic, so a stalled
        publish either landed before this (while no one else held the root) or
        fails after it.
        """
        staging = self.storage.path(layout.STAGING)
        if self.storage.exists(staging):
            self._to_trash(staging)  # before the lease is ours: no fence to check yet

    def after_lease(self) -> None:
        """Remove the pointer files a previous holder staged and has not linked or renamed into place
        yet (`latest`, tags, quarantine records: a compare-and-swap writes a temp file, checks the fence,
        then links it).

        A holder stopped right after its last fence check passed (before this lease was written)
        would otherwise move the pointer when it resumes; its link or rename now finds no source,
        and its fence check then raises. A temp file staged after this cannot be linked: its
        writer's fence check comes after it, and finds this lease.
        """
        for directory, tail in (
            (self.path, layout.LATEST),
            (self.storage.path(layout.TAGS), None),
            (self.storage.path(quarantine.DIR), None),
        ):
            for entry in self.storage.listdir(directory):
                if is_tmp_name_of(entry, tail):
                    self.storage.delete(os.path.join(directory, entry))

    # -- reading ----------------------------------------------------------------------
    def committed(self) -> list[CheckpointName]:
        """Every committed checkpoint directory (all versions), oldest first."""
        names = []
        for entry in self.storage.listdir(self.path):
            name = CheckpointName.parse(entry)
            if name is not None and self.storage.exists(rootkit.manifest_path(self.storage, name)):
                names.append(name)
        return sorted(names)

    def listing(self) -> DomainListing:
        """Every committed checkpoint of this domain: step -> {version: commit sequence number}."""
        out: DomainListing = {}
        for entry in self.storage.listdir(self.path):
            name = CheckpointName.parse(entry)
            if name is None:
                continue
            found, seq = rootkit.commit_seq(self.storage, name)
            if found:
                out.setdefault(name.step, {})[name.version] = seq
        return out

    def still_committed(self, name: CheckpointName, seq: int | None) -> bool:
        return rootkit.still_committed(self.storage, name, seq)

    def taken_versions(self, step: int) -> list[int]:
        """Versions of ``step`` a new save must not reuse beyond those :meth:`listing` shows: none."""
        return []

    def latest_seq(self) -> int:
        """The highest commit sequence number handed out in this root as far as `latest` knows (0 if
        none): the one it names, or a higher one it remembers from a step deleted since. A new commit
        is numbered above it, so a step deleted and saved again never gets its old number back (a
        reader holding the old manifest tells the two apart by it)."""
        return latest.high_seq(self.read_latest())

    def parse_manifest(
        self, name: CheckpointName, data: bytes, seq: int | None = None, part: tuple[int, int] = (0, 1)
    ) -> Manifest:
        manifest = rootkit.parse_manifest(self.storage, name, data, seq, part)
        self._check_real_dirs(name, manifest)
        return manifest

    def _check_real_dirs(self, name: CheckpointName, manifest: Manifest) -> None:
        """The step directory and every directory holding a file of the manifest are real directories:
        file opens refuse a link only in the last component, so a linked directory would lead reads out
        of the checkpoint (load and verify both read through here)."""
        base = self.dir(name)
        dirs = {base}
        for f in manifest.files:
            parent = os.path.dirname(f.path)
            while parent:
                dirs.add(os.path.join(base, parent))
                parent = os.path.dirname(parent)
        for path in sorted(dirs):
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue  # its files are missing: check_files and verify name them
            except OSError as e:
                raise CorruptCheckpointError(f"cannot inspect {path}: {e}", path=path) from e
            if not stat.S_ISDIR(mode):
                raise CorruptCheckpointError(
                    f"{path} is not a real directory (a symbolic link?) inside checkpoint {name.dirname}: "
                    "refusing to follow it out of the checkpoint; restore the directory or delete the step",
                    path=path,
                )

    def check_files(self, name: CheckpointName, manifest: Manifest, part: tuple[int, int] = (0, 1)) -> None:
        """Every file present with its recorded size (cheap: stat only; checksums are checked on read)."""
        base = self.dir(name)
        for f in manifest.files[part[0] :: part[1]]:
            path = os.path.join(base, f.path)
            size = self.storage.size(path)
            if size is None:
                if self.storage.exists(path):
                    raise CorruptCheckpointError(
                        f"{path} is not a regular file (a symbolic link, a FIFO, a directory?): refusing to read it",
                        path=path,
                    )
                raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete", path=path)
            if size != f.size:
                raise CorruptCheckpointError(
                    f"{path} has {size} bytes, the manifest says {f.size}: the checkpoint is corrupt", path=path
                )

    def walk(self, path: str) -> list[tuple[str, int]]:
        """Every entry under ``path`` with its size (rootkit.NOT_A_FILE: a symbolic link, FIFO, device)."""
        return rootkit.walk(self.storage, path, _real_dir)

    def unlisted_commits(self) -> dict[CheckpointName, str]:
        """None: a step directory holding its manifest is committed by being there."""
        return {}

    def garbage(self, keep_attempts: frozenset[str] = frozenset(), min_probe_age_s: float = 600.0) -> Garbage:
        staging = []
        for entry in self.storage.listdir(self.storage.path(layout.STAGING)):
            parsed = layout.parse_staging(entry)
            if parsed is None or parsed[1] not in keep_attempts:
                staging.append(self.storage.path(layout.STAGING, entry))
        trash = [self.storage.path(layout.TRASH, e) for e in self.storage.listdir(self.storage.path(layout.TRASH))]
        return Garbage(staging, trash, rootkit.old_probes(self.storage, min_probe_age_s))

    # -- writing (leaders only, under the lease) ----------------------------------------
    def make_staging(self, step: int, attempt: str) -> str:
        """The attempt's directory, made under the lease. A job stalled here while another took the root
        over (which moves the staging directory away) must not make its attempt again in the new
        owner's root: below the attempt nothing is created with its parents, and the lease is read
        once the attempt exists (it is removed again if the lease is lost: it is this save's own)."""
        path = self.staging_dir(step, attempt)
        self.storage.makedirs(os.path.dirname(path))
        self.storage.make_dir_durable(path)
        try:
            for sub in (layout.DATA_DIR, layout.FILES_DIR):
                self.storage.make_dir_durable(os.path.join(path, sub))
            self.storage.sync_dir(path)
            self.guard(f"create the attempt directory of step {step}")
        except BaseException as e:
            try:
                self.guard(f"create the attempt directory of step {step}")
            except LeaseLostError as lost:  # another job holds the root: it moved the attempt away, or
                self.storage.remove_tree(path)  # this job made it in the new holder's staging area
                raise lost from e
            raise
        return path

    def wait_files_visible(self, base: str, files: list[FileEntry], timeout: float) -> None:
        """Wait until every file is visible under ``base`` with its size (all parts visible).

        One directory listing per directory and round, not one lookup per file:
        at thousands of ranks, per-file lookups on NFS cost a round trip each,
        while a listing returns many entries (and, with READDIRPLUS, their
        attributes) at once.
        """
        pending: dict[str, dict[str, int]] = {}
        for f in files:
            d, _, name = f.path.rpartition("/")
            pending.setdefault(d, {})[name] = f.size
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            for d in list(pending):
                want = pending[d]
                seen = self.storage.sizes_in(os.path.join(base, d))
                if want.items() <= seen.items():  # every file there with its size (compared in C)
                    del pending[d]
                else:
                    pending[d] = {n: size for n, size in want.items() if seen.get(n) != size}
            if not pending:
                return
            if time.monotonic() >= deadline:
                missing = [os.path.join(base, d, n) for d, names in pending.items() for n in names]
                raise NotVisibleError(
                    f"{len(missing)} file(s) of this checkpoint are not visible with the right size after "
                    f"{timeout:.0f} s, e.g. {missing[0]}: a writer failed, or this node's view of the shared "
                    "filesystem is stale for longer than visibility_timeout_s.",
                    path=missing[0],
                )
            self.guard("wait for this save's files")  # a takeover moved them away: they never come
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def commit(self, staging: str, manifest: Manifest, last_check: Callable[[], None]) -> CheckpointName:
        """Write the manifest into the attempt, run ``last_check`` (it raises to stop the commit), and
        rename the attempt into place: the commit point. The checkpoint committed.

        A rename that reports an error may still have landed (NFS retransmits a
        rename whose reply was lost, and the retry fails with ENOENT): the outcome
        is settled by looking, and a rename that landed is a commit.
        """
        name = CheckpointName(manifest.step, manifest.version)
        self.storage.replace(os.path.join(staging, layout.MANIFEST), manifest.sealed_parts())
        last_check()
        try:
            self.storage.publish(staging, self.dir(name))
        except FileExistsError:
            if self._landed(staging, name):
                return name
            raise CheckpointError(
                f"{self.dir(name)} appeared while this save was in progress: another writer is active on {self.path}",
                path=self.dir(name),
            ) from None
        except OSError:
            if self._landed(staging, name):
                return name
            raise
        return name

    def _landed(self, staging: str, name: CheckpointName) -> bool:
        """Whether the attempt ``staging`` is now the checkpoint ``name`` (its source is gone and the
        manifest in place names that attempt)."""
        parsed = layout.parse_staging(os.path.basename(staging))
        if parsed is None or self.storage.exists(staging):
            return False
        try:
            return self.read_manifest(name).attempt == parsed[1]
        except (OSError, CheckpointError):
            return False

    def move_latest(self, name: CheckpointName, seq: int | None) -> bool:
        """Point `latest` at ``name`` unless it names a checkpoint committed later (:func:`latest.move`)."""
        return latest.move(
            self.storage,
            name,
            seq,
            fence=lambda: self.guard("move `latest`"),
            committed=lambda n: self.storage.exists(rootkit.manifest_path(self.storage, n)),
        )

    def latest_after_delete(self, deleted: int, left: DomainListing) -> None:
        """`latest` off the deleted step ``deleted`` (:func:`latest.after_delete`)."""
        latest.after_delete(self.storage, deleted, left, fence=lambda: self.guard("move `latest`"))

    def retire(self, path: str) -> str | None:
        """Take a checkpoint or leftover out of sight atomically (rename into trash); the trash path."""
        self.guard(f"retire {path}")
        return self._to_trash(path)

    def _to_trash(self, path: str) -> str | None:
        trash_root = self.storage.path(layout.TRASH)
        if os.path.dirname(path) == trash_root:
            return path
        self.storage.makedirs(trash_root)
        target = os.path.join(trash_root, f"{os.path.basename(path)}.{os.urandom(6).hex()}")
        try:
            self.storage.publish(path, target)
        except FileNotFoundError:
            return None
        return target

    def discard_attempt(self, staging: str, name: CheckpointName, attempt: str) -> None:
        """Remove the data of a save that failed, unless it may be committed after all.

        The commit is the rename of ``staging``: once it landed there is no
        ``staging`` left to remove, so what is left is certainly not committed.
        A job that lost the root removes nothing (the new holder clears leftovers).
        """
        self.invalidate(staging)


def _real_dir(path: str) -> bool:
    """A directory, not a symbolic link to one (a loop would never end, a link elsewhere leaves the root)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
