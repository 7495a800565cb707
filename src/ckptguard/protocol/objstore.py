"""A checkpoint root on an object store: commit by conditional create, found through a CAS'd index.

Object stores have no rename and (historically) no consistent listing, so the
POSIX commit (rename the attempt directory into place) becomes::

    .ckptguard/staging/step-N.<attempt>/data/...   every rank's objects; they stay here once committed
    step-0000000N/MANIFEST.json                    the commit object: the manifest, created with
                                                   If-None-Match: * (exactly one attempt wins a step
                                                   version; it names its attempt, so its data)
    .ckptguard/index.json                          the catalog: every commit in order, updated by
                                                   compare-and-swap on its ETag
    latest                                         moved by compare-and-swap, never backwards

The index is what ``steps()``, ``latest`` and retention read; a listing is used
only to find garbage (abandoned attempts, orphaned multipart uploads), so a
stale listing cannot change a load or commit decision.

Fencing. The index carries an epoch. A job that takes the root's lease bumps it
(:meth:`ObjectStoreRoot.after_lease`) and from then on every index update of an
older job fails (the update is a CAS and checks the epoch). Before its commit
object is created, an attempt is recorded in the index as *pending* (an
intent). Taking over resolves every pending intent of an older job: it creates
a tombstone at that attempt's commit key with If-None-Match: *; if that
succeeds, the stalled attempt can never commit (its own conditional create gets
412 and it raises); if it fails, the attempt did commit, and is adopted. So a
commit object always ends up in the index, and a stalled job resumed after a
takeover commits nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Literal

from ckptguard.errors import (
    CheckpointError,
    CommitOutcomeUnknownError,
    CorruptCheckpointError,
    LeaseLostError,
    NotVisibleError,
)
from ckptguard.protocol import latest, layout, objgarbage, records, rootkit
from ckptguard.protocol.cas import Keep, Put, swap
from ckptguard.protocol.decisions import DomainListing
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import FileEntry, Manifest
from ckptguard.protocol.objindex import Index, IndexEntry, tombstone_record
from ckptguard.protocol.rootkit import Garbage
from ckptguard.protocol.topology import Topology, probe_object_store
from ckptguard.storage import StorageBackend, backend_for
from ckptguard.storage.condprobe import check_conditional_writes

if TYPE_CHECKING:
    from collections.abc import Callable

    from ckptguard.comm import Comm

log = logging.getLogger("ckptguard")


class ObjectStoreRoot(rootkit.RootKit):
    """One checkpoint root on an object store (see the module docstring)."""

    #: what the store itself checks on arrival (S3 CRC32C): the manifest records the same
    default_checksum = "crc32c"

    def __init__(self, storage: StorageBackend) -> None:
        super().__init__(storage)
        self.index_path = storage.path(layout.INDEX)
        self.epoch: int | None = None  # the index epoch this job took with the lease (writers only)

    # -- where things are ---------------------------------------------------------------
    def location(self) -> Literal["ok", "missing", "not a directory"]:
        """Always "ok": a prefix exists once something is written under it."""
        return "ok"

    def local_dir(self) -> str | None:
        """None: an object store is no directory here (a files= path cannot lie inside it)."""
        return None

    def probe_domains(self, comm: Comm, *, write: bool) -> Topology:
        """One domain (every rank reaches the same store), checked by a probe object when writing."""
        return probe_object_store(comm, self.storage, write=write)

    # -- the index ---------------------------------------------------------------------
    def read_index(self) -> tuple[Index, str | None]:
        got = self.storage.read_versioned(self.index_path)
        if got is None:
            self._check_no_commits()
            return Index(), None
        return Index.from_bytes(got[0], self.index_path), got[1]

    def _check_no_commits(self) -> None:
        """An absent index is a fresh root only where no commit object exists: otherwise the index was
        lost, and treating the root as empty would hide committed steps and offer their data as garbage."""
        for entry in self.storage.listdir(self.storage.path()):
            name = CheckpointName.parse(entry)
            if name is not None and self.storage.exists(self.commit_path(name)):
                raise CorruptCheckpointError(
                    f"{self.index_path} is missing but the commit object {self.commit_path(name)} exists: the "
                    "index of this root was deleted. Nothing was changed; restore index.json (e.g. from a "
                    "bucket version) before loading or saving here.",
                    path=self.index_path,
                )

    def update_index(self, change: Callable[[Index], bool], what: str, fencing: bool = False) -> Index:
        """Apply ``change`` to the index by compare-and-swap (re-read and re-applied on a race).

        ``change`` edits the index in place and says whether anything changed; it
        must be idempotent (a CAS retried after a 5xx may already have landed).
        Unless ``fencing``, the update is refused once a newer job took the root.
        """

        def decide(found: Index | None) -> Put[Index, Index] | Keep[Index]:
            if found is None:
                self._check_no_commits()
            index = found if found is not None else Index()
            if not fencing:  # the fence: checked on the very version the swap replaces
                self._check_epoch(index, what)
            return Put(index, index) if change(index) else Keep(index)

        updated: Index = swap(
            self.storage,
            self.index_path,
            decode=self._decode_index,
            encode=Index.to_bytes,
            decide=decide,
            fence=None,
            what=what,
            rounds=64,
        )
        return updated

    def _decode_index(self, data: bytes) -> Index:
        return Index.from_bytes(data, self.index_path)

    def guard(self, acting: str) -> None:
        """The lease, and the index epoch: a job that took the root over bumped it."""
        self._fence.check(acting)
        if self.epoch is not None:
            self._check_epoch(self.read_index()[0], acting)

    def _check_epoch(self, index: Index, what: str) -> None:
        if self.epoch is None:
            raise CheckpointError(
                f"cannot {what}: this job did not take the lease on {self.path}", path=self.index_path
            )
        if index.epoch != self.epoch:
            raise LeaseLostError(
                f"refusing to {what}: another job took over {self.path} (index epoch {index.epoch}, this job's "
                f"{self.epoch}) after this job's lease expired; nothing was committed by this call.",
                path=self.index_path,
            )

    def after_lease(self) -> None:
        """Fence every older job out of the index and settle what they left pending (lease holder). The
        lease is checked in every round, on the version the swap replaces: a job whose lease expired while
        it got here must not bump the epoch of the job that took over, nor tombstone its commits."""
        settled: list[str] = []

        def take(index: Index) -> bool:
            self._fence.check("take over the root")
            settled.clear()
            index.epoch += 1
            for e in index.entries:
                if e.state == "pending":
                    settled.append(self.settle(e, index))
            return True

        index = self.update_index(take, "take over the root", fencing=True)
        self.epoch = index.epoch
        if settled:
            log.info(
                "ckptguard: %s: settled attempts left pending by an earlier job: %s", self.path, ", ".join(settled)
            )

    def settle(self, entry: IndexEntry, index: Index) -> str:
        """A pending attempt (not in flight: it belongs to a job fenced off, or to an earlier failed save of
        this one): adopt it if its commit object exists, else make sure it never will (tombstone)."""
        commit = self.commit_path(entry.name)
        tombstone = tombstone_record(entry.attempt, index.epoch)
        if self.storage.create_exclusive(commit, tombstone) or self._is_tombstone(commit):
            entry.state = "aborted"
            return f"{entry.name.dirname} ({entry.attempt}) aborted"
        manifest = self._commit_manifest(entry.name)
        if manifest is not None and manifest.attempt == entry.attempt:
            # The manifest's own sequence number, so that listing, `latest` and the manifest agree (a
            # parsed manifest always has one: rootkit.parse_manifest refuses one without).
            seq = manifest.commit_seq
            assert seq is not None
            entry.state, entry.seq = "committed", seq
            index.next_seq = max(index.next_seq, seq + 1)
            return f"{entry.name.dirname} ({entry.attempt}) committed"
        entry.state = "aborted"  # another attempt holds that key: this one lost
        return f"{entry.name.dirname} ({entry.attempt}) lost to another attempt"

    def _is_tombstone(self, commit: str) -> bool:
        try:
            records.decode(self.storage.read_bytes(commit), records.TombstoneRecord, commit)
        except (FileNotFoundError, CorruptCheckpointError):
            return False  # absent, or a manifest
        return True

    def _commit_attempt(self, name: CheckpointName) -> str | None:
        """The attempt a commit object names (None: absent, a tombstone or not a manifest)."""
        manifest = self._commit_manifest(name)
        return manifest.attempt if manifest is not None else None

    def parse_manifest(
        self, name: CheckpointName, data: bytes, seq: int | None = None, part: tuple[int, int] = (0, 1)
    ) -> Manifest:
        return rootkit.parse_manifest(self.storage, name, data, seq, part)

    def _commit_manifest(self, name: CheckpointName) -> Manifest | None:
        try:
            return self.parse_manifest(name, self.read_manifest_bytes(name))
        except CheckpointError:
            return None

    # -- reading -------------------------------------------------------------------------
    def commit_path(self, name: CheckpointName) -> str:
        return rootkit.manifest_path(self.storage, name)

    def data_dir(self, name: CheckpointName, manifest: Manifest) -> str:
        return self.staging_dir(manifest.step, manifest.attempt)

    def committed(self, index: Index | None = None) -> list[CheckpointName]:
        """From the index: committed entries, and pending ones whose commit object names their attempt
        (a commit whose index update has not happened yet: a crash there loses nothing)."""
        if index is None:
            index, _ = self.read_index()
        names = [e.name for e in index.entries if e.state == "committed"]
        for e in index.entries:
            if e.state == "pending" and self._commit_attempt(e.name) == e.attempt:
                names.append(e.name)
        return sorted(set(names))

    def unlisted_commits(self) -> dict[CheckpointName, str]:
        """Manifests at step keys that the index does not list (read after them: a commit landing meanwhile
        is listed, not reported)."""
        listed = set(self.committed())  # only keys it does not list are read (a GET each)
        found: dict[CheckpointName, str] = {}
        for entry in self.storage.listdir(self.storage.path()):
            name = CheckpointName.parse(entry)
            manifest = self._commit_manifest(name) if name is not None and name not in listed else None
            if name is not None and manifest is not None:
                found[name] = manifest.attempt
        if not found:
            return {}
        committed = set(self.committed())
        return {name: attempt for name, attempt in found.items() if name not in committed}

    def listing(self) -> DomainListing:
        """From the index (never a LIST): step -> {version: commit sequence number} of every committed
        checkpoint, the sequence number being the one its manifest records."""
        index, _ = self.read_index()
        committed = set(self.committed(index))
        out: DomainListing = {}
        for e in index.entries:
            if e.name in committed:
                out.setdefault(e.step, {})[e.version] = e.seq
        return out

    def still_committed(self, name: CheckpointName, seq: int | None) -> bool:
        """Retention takes a checkpoint out of the index before it deletes its commit object, so one the
        index still holds as committed (with the same sequence number) was not retired: if its commit
        object is gone, the checkpoint is damaged, not retired."""
        entry = self.read_index()[0].find(name)
        if entry is None or entry.state == "aborted":
            return False
        if seq is not None and entry.seq is not None and entry.seq != seq:
            return False  # retired and saved again under the same name
        if entry.state == "committed":
            return True
        return rootkit.still_committed(self.storage, name, seq)

    def latest_seq(self) -> int:
        """The highest commit sequence number `latest` knows, and every number the index handed out (a
        step deleted and saved again gets a new one)."""
        return max(latest.high_seq(self.read_latest()), self.read_index()[0].next_seq - 1)

    def walk(self, path: str) -> list[tuple[str, int]]:
        """Every object under ``path`` with its size (a prefix holds nothing but objects)."""
        return rootkit.walk(self.storage, path, lambda _: True)

    def taken_versions(self, step: int) -> list[int]:
        """Versions of ``step`` already used: committed, pending or aborted (their keys are taken)."""
        index, _ = self.read_index()
        return [e.version for e in index.entries if e.step == step]

    def check_files(self, name: CheckpointName, manifest: Manifest, part: tuple[int, int] = (0, 1)) -> None:
        base = self.data_dir(name, manifest)
        for f, size in rootkit.head_all(self.storage, base, manifest.files[part[0] :: part[1]]):
            path = self.storage.join(base, f.path)
            if size is None:
                raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete", path=path)
            if size != f.size:
                raise CorruptCheckpointError(
                    f"{path} has {size} bytes, the manifest says {f.size}: the checkpoint is corrupt", path=path
                )

    # -- writing (the lease holder only) -------------------------------------------------------
    def make_staging(self, step: int, attempt: str) -> str:
        return self.staging_dir(step, attempt)  # a prefix: nothing to create

    def wait_files_visible(self, base: str, files: list[FileEntry], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(files)
        delay = 0.05
        while True:
            pending = [f for f, size in rootkit.head_all(self.storage, base, pending) if size != f.size]
            if not pending:
                return
            if time.monotonic() >= deadline:
                missing = self.storage.join(base, pending[0].path)
                raise NotVisibleError(
                    f"{len(pending)} object(s) of this checkpoint are missing or have the wrong "
                    f"size after {timeout:.0f} s, e.g. {missing}: a writer failed.",
                    path=missing,
                )
            self.guard("wait for this save's files")  # a takeover moved them away: they never come
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def commit(self, staging: str, manifest: Manifest, last_check: Callable[[], None]) -> CheckpointName:
        """Record the intent to commit in the index, run ``last_check`` (it raises to stop the commit),
        and create the manifest at its step's key: the commit point. The checkpoint committed.

        The order is the protocol's: an intent the index does not hold could not be
        settled by a job that takes the root over (see the module docstring)."""
        name = CheckpointName(manifest.step, manifest.version)
        data = self._record_intent(name, manifest)
        last_check()
        self._publish(name, data)
        return name

    def _record_intent(self, name: CheckpointName, manifest: Manifest) -> bytes:
        """Record the intent to commit (in the index, under this job's epoch); the manifest's bytes."""
        entry = IndexEntry(
            manifest.step, manifest.version, manifest.attempt, "pending", self.epoch or 0, manifest.commit_seq
        )

        def intend(index: Index) -> bool:
            for e in index.entries:
                if e.state == "pending" and e.attempt != manifest.attempt:
                    self.settle(e, index)  # an earlier failed save of this job
            found = index.find(name)
            if found is not None:
                if found.attempt == manifest.attempt:
                    return False  # our own intent, recorded by a try whose answer was lost
                raise CheckpointError(
                    f"{name.dirname} in {self.path} is already taken by attempt {found.attempt} ({found.state})",
                    path=self.commit_path(name),
                )
            index.entries.append(entry)
            return True

        self.update_index(intend, f"record the commit of {name.dirname}")
        return manifest.to_json()

    def _publish(self, name: CheckpointName, data: bytes) -> None:
        """The commit point: the manifest created at its step's key only if nothing is there yet.

        A create whose answer is lost (and whose retries got no answer either) may
        have landed: its outcome is settled by reading the key back, never assumed.
        Once the commit object is ours the step is committed, whatever happens to
        the index update after it.
        """
        commit = self.commit_path(name)
        attempt = Manifest.from_json(data, "MANIFEST.json").attempt
        try:
            created = self.storage.create_exclusive(commit, data)
        except OSError as e:
            created = self._settle_own_commit(name, attempt, e)
        if not created:
            if self._is_tombstone(commit):
                raise LeaseLostError(
                    f"{name.dirname} was not committed: another job took over {self.path} while this one "
                    "stalled, and aborted this attempt (a tombstone holds its commit key).",
                    path=commit,
                )
            raise CheckpointError(
                f"{commit} appeared while this save was in progress: another writer committed "
                f"{name.dirname} first on {self.path}",
                path=commit,
            )

        def mark(index: Index) -> bool:
            e = index.find(name)
            if e is None or e.attempt != attempt:
                raise CheckpointError(f"{name.dirname} is committed but its index entry vanished", path=commit)
            if e.state == "committed":
                return False  # adopted meanwhile, or our own retried update
            # The commit sequence number is the manifest's (decided by rank 0 at plan time, above any
            # seen), so listing, `latest` and the manifest agree; next_seq keeps the highest number
            # handed out (latest_seq reads it: a step deleted and saved again gets a new one).
            e.state, e.seq = "committed", Manifest.from_json(data, "MANIFEST.json").commit_seq
            index.next_seq = max(index.next_seq, (e.seq or 0) + 1)
            return True

        try:
            self.update_index(mark, f"index the commit of {name.dirname}")
        except LeaseLostError as e:
            # Fenced off between the create and here: the commit object is ours, and the new holder
            # adopts it when it settles pending intents.
            raise LeaseLostError(
                f"{name.dirname} is committed (its commit object {commit} is in place), but "
                f"another job took over {self.path} before it was indexed; that job adopts it, "
                "and this job writes nothing more to the root.",
                path=commit,
            ) from e
        except OSError as e:
            # Committed all the same: a pending entry whose commit object names its attempt is listed as
            # committed, and the next index update of any job records it.
            log.warning(
                "ckptguard: %s is committed, but recording it in %s failed (it is recorded by the next save): %s",
                name.dirname,
                self.index_path,
                e,
            )

    def _settle_own_commit(self, name: CheckpointName, attempt: str, err: OSError) -> bool:
        """The create of our commit object failed without a clear answer: did it land? True if the commit
        object is ours, False if another's; ``err`` again if it had not landed (a tombstone of our own now
        makes sure it never lands late: nothing is committed); CommitOutcomeUnknownError if that cannot
        be learned."""
        commit = self.commit_path(name)
        tombstone = tombstone_record(attempt, self.epoch or 0)
        try:
            created = self.storage.create_exclusive(commit, tombstone)
            if not created:
                return self._commit_attempt(name) == attempt
        except OSError as again:
            raise CommitOutcomeUnknownError(
                f"the commit of {name.dirname} on {self.path} got no answer ({err}), nor did reading it back "
                f"({again}): it may or may not be committed. Its data is kept; the next save, or the next job to "
                "take this root, settles it (adopts it if the commit landed, aborts it if not).",
                path=commit,
            ) from err
        raise err

    def fence_staging(self) -> None:
        """Before a job takes the lease: a store that does not check its own conditional writes is probed
        (:mod:`ckptguard.storage.condprobe`). Fencing is through the index epoch, after the lease is taken
        (after_lease)."""
        if not backend_for(self.storage.root).checks_own_writes:
            check_conditional_writes(self.storage, self.storage.path(layout.PROBE))

    def move_latest(self, name: CheckpointName, seq: int | None) -> bool:
        """Point `latest` at ``name`` unless it names a checkpoint committed later (:func:`latest.move`)."""
        return latest.move(
            self.storage,
            name,
            seq,
            fence=lambda: self.guard("move `latest`"),
            committed=lambda n: self.storage.exists(self.commit_path(n)),
        )

    def latest_after_delete(self, deleted: int, left: DomainListing) -> None:
        """`latest` off the deleted step ``deleted`` (:func:`latest.after_delete`)."""
        latest.after_delete(self.storage, deleted, left, fence=lambda: self.guard("move `latest`"))

    def retire(self, path: str) -> str | None:
        """A committed checkpoint out of the index, then its commit object (:func:`objgarbage.retire`)."""
        return objgarbage.retire(self, path)

    def discard_attempt(self, staging: str, name: CheckpointName, attempt: str) -> None:
        """Remove a failed save's data unless it may commit after all (:func:`objgarbage.discard_attempt`)."""
        objgarbage.discard_attempt(self, staging, name, attempt)

    def garbage(self, keep_attempts: frozenset[str] = frozenset(), min_probe_age_s: float = 600.0) -> Garbage:
        """Attempts no index entry names, attempts with multipart uploads left open
        (:func:`~ckptguard.protocol.objgarbage.staging_garbage`), old probes."""

        def live() -> set[str]:
            unlisted = set(self.unlisted_commits().values())  # a commit's data, whatever the index says
            return unlisted | {e.attempt for e in self.read_index()[0].entries if e.state != "aborted"}

        staging = objgarbage.staging_garbage(self.storage, live, keep_attempts, self.guard)
        return Garbage(staging, [], rootkit.old_probes(self.storage, min_probe_age_s))
