"""One checkpoint root as this rank sees it: listing, manifests, staging, the `latest` pointer.

Only domain leaders call the listing and mutating methods (I4: one rank per
storage domain evaluates every predicate that steers control flow; the others
follow what it broadcasts).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    MalformedRecordError,
    NotVisibleError,
)
from ckptguard.protocol import layout, records
from ckptguard.protocol.cas import Keep, Put, swap
from ckptguard.protocol.decisions import DomainListing
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import HEAD_BYTES, FileEntry, Manifest, commit_seq_from_head
from ckptguard.storage import StorageBackend


@dataclass(frozen=True)
class Garbage:
    """Leftovers a crash can leave: attempts never published, checkpoints half-deleted, old probes.

    (Versions of a step that are not the one every domain agrees on are found from the
    agreed listing: :func:`ckptguard.protocol.decisions.stray_versions`.)
    """

    staging: list[str]
    trash: list[str]
    probes: list[str]


class CheckpointRoot:
    def __init__(self, storage: StorageBackend) -> None:
        self.storage = storage
        self._fence: Callable[[str], None] | None = None

    # -- the fence ----------------------------------------------------------------------
    def set_fence(self, fence: Callable[[str], None]) -> None:
        """``fence(acting)`` raises LeaseLostError once this job no longer holds the root (set by the
        session once the lease is taken; a root without one is a tool's, or a reader's)."""
        self._fence = fence

    def guard(self, acting: str) -> None:
        """Raise LeaseLostError unless this job still holds the root: called immediately before every
        change to shared state (a pointer move, a retirement, a removal), so a job that stalled while
        another took the root over changes nothing of the new holder's."""
        if self._fence is not None:
            self._fence(acting)

    @property
    def path(self) -> str:
        return self.storage.root

    def dir(self, name: CheckpointName) -> str:
        return self.storage.path(name.dirname)

    def staging_dir(self, step: int, attempt: str) -> str:
        return self.storage.path(layout.STAGING, layout.staging_dirname(step, attempt))

    # -- reading ----------------------------------------------------------------------
    def committed(self) -> list[CheckpointName]:
        """Every committed checkpoint directory (all versions), oldest first."""
        names = []
        for entry in self.storage.listdir(self.path):
            name = CheckpointName.parse(entry)
            if name is not None and self.storage.exists(os.path.join(self.path, entry, layout.MANIFEST)):
                names.append(name)
        return sorted(names)

    def current(self) -> dict[int, CheckpointName]:
        """The newest version of each committed step in this domain (tools; the protocol agrees on
        versions across domains with :meth:`listing`)."""
        return layout.newest_versions(self.committed())

    def listing(self) -> DomainListing:
        """Every committed checkpoint of this domain: step -> {version: commit sequence number}."""
        out: DomainListing = {}
        for entry in self.storage.listdir(self.path):
            name = CheckpointName.parse(entry)
            if name is None:
                continue
            found, seq = self.commit_seq(name)
            if found:
                out.setdefault(name.step, {})[name.version] = seq
        return out

    def commit_seq(self, name: CheckpointName) -> tuple[bool, int | None]:
        """(committed?, its commit sequence number) from the head of its manifest.

        A manifest without a sequence number in its head (an older ckptguard, or a
        damaged head) is read whole; one that does not parse still counts as committed
        (a load will report it corrupt), without a sequence number.
        """
        path = os.path.join(self.dir(name), layout.MANIFEST)
        try:
            handle = self.storage.open_read(path)
        except CorruptCheckpointError:  # missing (not committed), or not a regular file
            return self.storage.exists(path), None
        try:
            head = bytearray(min(HEAD_BYTES, handle.size()))
            handle.read_into([memoryview(head)], 0)
        finally:
            handle.close()
        seq = commit_seq_from_head(bytes(head))
        if seq is None:
            try:
                seq = self.read_manifest(name).commit_seq
            except CorruptCheckpointError:
                seq = None
        return True, seq

    def still_committed(self, name: CheckpointName, seq: int | None) -> bool:
        """Whether ``name`` is still the checkpoint that was listed with commit sequence number ``seq``.

        False when it was retired, and also when it was retired and saved again
        under the same name (a step deleted and saved anew): a reader holding the
        old manifest must list again, not call the new one corrupt.
        """
        found, now = self.commit_seq(name)
        return found and (seq is None or now is None or now == seq)

    def latest_seq(self) -> int:
        """The highest commit sequence number handed out in this root as far as `latest` knows (0 if
        none): the one it names, or a higher one it remembers from a step deleted since. A new commit
        is numbered above it, so a step deleted and saved again never gets its old number back (a
        reader holding the old manifest tells the two apart by it)."""
        body = self.read_latest()
        if body is None:
            return 0
        return max(_seq(body.get("seq")), _seq(body.get("high_seq")))

    def read_manifest(self, name: CheckpointName) -> Manifest:
        return self.parse_manifest(name, self.read_manifest_bytes(name))

    def read_manifest_bytes(self, name: CheckpointName) -> bytes:
        path = os.path.join(self.dir(name), layout.MANIFEST)
        try:
            return self.storage.read_bytes(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing", path=path) from None

    def parse_manifest(self, name: CheckpointName, data: bytes, seq: int | None = None) -> Manifest:
        """Parse and check a manifest; ``seq``: the commit sequence number it was listed with."""
        path = os.path.join(self.dir(name), layout.MANIFEST)
        m = Manifest.from_json(data, path)
        if m.step != name.step or m.version != name.version:
            raise CorruptCheckpointError(
                f"{path} describes step {m.step} v{m.version} but sits in {name.dirname}: "
                "the directory was renamed or copied by hand", path=path)
        if seq is not None and m.commit_seq != seq:
            raise CorruptCheckpointError(
                f"{path} records commit sequence number {m.commit_seq}, its head said {seq}: the manifest is "
                "corrupt", path=path)
        return m

    def check_files(self, name: CheckpointName, manifest: Manifest) -> None:
        """Every file present with its recorded size (cheap: stat only; checksums are checked on read)."""
        base = self.dir(name)
        for f in manifest.files:
            path = os.path.join(base, f.path)
            size = self.storage.size(path)
            if size is None:
                if self.storage.exists(path):
                    raise CorruptCheckpointError(f"{path} is not a regular file (a symbolic link, a FIFO, a "
                                                 "directory?): refusing to read it", path=path)
                raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete", path=path)
            if size != f.size:
                raise CorruptCheckpointError(f"{os.path.join(base, f.path)} has {size} bytes, the manifest "
                                             f"says {f.size}: the checkpoint is corrupt",
                                             path=os.path.join(base, f.path))

    def read_latest(self) -> dict[str, object] | None:
        try:
            return latest_body(self.storage.read_bytes(self.storage.path(layout.LATEST)))
        except (FileNotFoundError, CorruptCheckpointError):
            return None

    def garbage(self, keep_attempts: frozenset[str] = frozenset(), min_probe_age_s: float = 600.0) -> Garbage:
        staging = []
        for entry in self.storage.listdir(self.storage.path(layout.STAGING)):
            parsed = layout.parse_staging(entry)
            if parsed is None or parsed[1] not in keep_attempts:
                staging.append(self.storage.path(layout.STAGING, entry))
        trash = [self.storage.path(layout.TRASH, e) for e in self.storage.listdir(self.storage.path(layout.TRASH))]
        probes = []
        now = time.time()
        for entry in self.storage.listdir(self.storage.path(layout.PROBE)):
            p = self.storage.path(layout.PROBE, entry)
            mtime = self.storage.mtime(p)
            if mtime is not None and now - mtime > min_probe_age_s:
                probes.append(p)
        return Garbage(staging, trash, probes)

    # -- writing (leaders only, under the lease) ----------------------------------------
    def make_staging(self, step: int, attempt: str) -> str:
        path = self.staging_dir(step, attempt)
        self.storage.makedirs(os.path.dirname(path))
        self.storage.make_dir_durable(path)
        for sub in (layout.DATA_DIR, layout.FILES_DIR):
            self.storage.makedirs(os.path.join(path, sub))
        self.storage.sync_dir(path)
        return path

    def wait_files_visible(self, base: str, files: list[FileEntry], timeout: float) -> None:
        """Wait until every file is visible under ``base`` with its size (I6: all parts visible).

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
                for entry, seen in self.storage.sizes_in(os.path.join(base, d)).items():
                    if want.get(entry) == seen:
                        del want[entry]
                if not want:
                    del pending[d]
            if not pending:
                return
            if time.monotonic() >= deadline:
                missing = [os.path.join(base, d, n) for d, names in pending.items() for n in names]
                raise NotVisibleError(
                    f"{len(missing)} file(s) of this checkpoint are not visible with the right size after "
                    f"{timeout:.0f} s, e.g. {missing[0]}: a writer failed, or this node's view of the shared "
                    "filesystem is stale for longer than visibility_timeout_s.", path=missing[0])
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def write_manifest(self, staging: str, manifest: Manifest) -> None:
        self.storage.replace(os.path.join(staging, layout.MANIFEST), manifest.to_json())

    def publish(self, staging: str, name: CheckpointName) -> None:
        """The commit point: the attempt directory becomes the checkpoint, atomically.

        A rename that reports an error may still have landed (NFS retransmits a
        rename whose reply was lost, and the retry fails with ENOENT): the outcome
        is settled by looking, and a rename that landed is a commit.
        """
        try:
            self.storage.publish(staging, self.dir(name))
        except FileExistsError:
            if self._landed(staging, name):
                return
            raise CheckpointError(
                f"{self.dir(name)} appeared while this save was in progress: another writer is active on "
                f"{self.path}", path=self.dir(name)) from None
        except OSError:
            if self._landed(staging, name):
                return
            raise

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
        """Point `latest` at ``name`` unless it already names a checkpoint committed later.

        "Later" is commit order (the sequence number), not the step number: after a
        rollback, step 110 committed after step 300 is the newer one. Compare-and-swap
        on the pointer's version: a writer that read an older pointer cannot overwrite a
        newer one written meanwhile, and a stalled job (whose commit is older than any
        commit of the job that took the root over) never moves it backwards.
        """
        path = self.storage.path(layout.LATEST)

        def decide(cur: dict[str, object] | None) -> Put[dict[str, object], bool] | Keep[bool]:
            if cur is not None:
                cur_seq = cur.get("seq")
                cur_name = CheckpointName.parse(str(cur.get("dir", "")))
                if isinstance(cur_seq, int) and (seq is None or cur_seq >= seq) and cur_name is not None \
                        and cur_name != name and self.storage.exists(os.path.join(self.dir(cur_name), layout.MANIFEST)):
                    return Keep(False)
            body: dict[str, object] = {"step": name.step, "dir": name.dirname, "updated_at": time.time()}
            if seq is not None:
                body["seq"] = seq
            high = high_seq(cur, seq)
            if high:
                body["high_seq"] = high
            return Put(body, True)

        moved: bool = swap(self.storage, path, decode=latest_body, encode=encode_latest, decide=decide,
                           fence=lambda: self.guard("move `latest`"), what="move `latest`")
        return moved

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

    def invalidate(self, path: str) -> None:
        """Delete a checkpoint or leftover: first rename it out of sight (atomic), then remove it."""
        retired = self.retire(path)
        if retired is not None:
            self.remove_retired(retired)

    def remove_retired(self, path: str) -> None:
        """Remove the bytes of something :meth:`retire` took out of sight (under the fence)."""
        self.guard(f"remove {path}")
        self.storage.remove_tree(path)

    def discard_attempt(self, staging: str, name: CheckpointName, attempt: str) -> None:
        """Remove the data of a save that failed, unless it may be committed after all.

        On POSIX the commit is the rename of ``staging``: once it landed there is
        no ``staging`` left to remove, so what is left is certainly not committed.
        A job that lost the root removes nothing (the new holder clears leftovers).
        """
        self.invalidate(staging)

    # -- where object stores differ (protocol/objstore.py overrides these) ------------------
    def taken_versions(self, step: int) -> list[int]:
        """Versions of ``step`` a new save must not reuse beyond those :meth:`listing` shows (none on
        POSIX; on object stores, versions whose commit key a pending or aborted attempt holds)."""
        return []

    def data_dir(self, name: CheckpointName, manifest: Manifest) -> str:
        """Where the files of a committed checkpoint are (its directory on POSIX)."""
        return self.dir(name)

    def after_lease(self) -> None:
        """Runs once this job holds the root's lease (POSIX fences before, in fence_staging)."""


def _seq(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def high_seq(body: dict[str, object] | None, seq: int | None = None) -> int:
    """The highest commit sequence number a `latest` body names or remembers, and ``seq``."""
    if body is None:
        return seq or 0
    return max(_seq(body.get("seq")), _seq(body.get("high_seq")), seq or 0)


def encode_latest(body: dict[str, object]) -> bytes:
    return (json.dumps(body) + "\n").encode()


def latest_body(data: bytes) -> dict[str, object] | None:
    """The pointer's fields, or None where it is unreadable (a hint: the listing decides, not `latest`)."""
    try:
        return msgspec.structs.asdict(records.decode(data, records.LatestRecord, layout.LATEST))
    except MalformedRecordError:
        return None
