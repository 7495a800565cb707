"""The one exception hierarchy of ckptguard.

Every failure a caller can act on is a ``CheckpointError``; its subclass says
what went wrong, so code matches types, never message text::

    CheckpointError(RuntimeError)          rank, path: who failed, on what
     ├── LeaseError                        fencing between jobs on one root
     │    ├── LeaseHeldError               another live job holds the root
     │    └── LeaseLostError               this job's lease was taken over
     ├── StepExistsError                   the step is committed; overwrite=False
     ├── StepNotFoundError                 load(step=N) of a step not committed
     │    └── StepRetiredError             ... retired (retention) while it was being read
     ├── PathCollisionError                two ranks' files= paths overlap
     ├── ReplicatedValueError              a plain value (stored once) differs across ranks
     ├── StorageError                      the storage refused an operation
     │    ├── CommitOutcomeUnknownError    a commit got no answer: it may have landed
     │    ├── DiskFullError                ENOSPC, EDQUOT
     │    ├── StoragePermissionError       EACCES, EPERM, EROFS
     │    ├── StaleHandleError             ESTALE that outlived its retries
     │    ├── NotVisibleError              a file another rank wrote never showed
     │    ├── BucketNotFoundError          an object store's bucket does not exist
     │    ├── WrongRegionError             the bucket is in another region than the client's
     │    └── UnsupportedStorageError      a URL scheme without a backend, or a store that ignores
     │                                     conditional writes
     ├── UnsafeObjectError                 an object that would need unpickling code
     ├── UnsupportedValueError             save of a value load could not give back (also TypeError)
 ├── InvalidArgumentError              an argument's value refused: a NaN in metadata=, a negative
 │                                     step (also ValueError; raised alike on every rank)
     ├── TemplateMismatchError             load into a state whose shapes or keys differ (also ValueError)
     ├── CorruptCheckpointError            bytes that do not match the manifest
     │    └── MalformedRecordError         a record (manifest, latest, tag, lease, index, header)
     │                                     too large, too deep or not its schema: names the field
     ├── TornLoadError                     a file changed between verifying and copying into place
     └── PeerError                         another rank failed with a non-ckptguard error

Errors cross ranks as a :class:`FailureRecord` (class name, message, rank,
host, path) and are rebuilt there as the same class; :func:`from_os_error` is
the one place an ``OSError`` becomes a typed error.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any


class CheckpointError(RuntimeError):
    """A save, load or verification that cannot proceed safely.

    The base of every error ckptguard raises on purpose: catch it to handle them all, or a subclass
    to handle one kind. The message says what happened and what to do.

    Args:
        message: What went wrong and what to do.
        rank: The rank that failed first (None where no single rank is to blame).
        path: The file or directory involved, where one is.

    Attributes:
        rank: The rank that failed first, or None.
        path: The file or directory involved, or None.
    """

    def __init__(self, message: str, *, rank: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors travel between processes pickled (multiprocessing, tests); keep rank and path.
        return (_rebuild, (type(self), str(self), self.rank, self.path))


class LeaseError(CheckpointError):
    """The root's lease (one writing job per root) stands in the way.

    Catch it to handle both ``LeaseHeldError`` and ``LeaseLostError``.
    """


class LeaseHeldError(LeaseError):
    """Another job holds the root's lease and keeps renewing it.

    Raised by ``Checkpointer(root)`` for writing. Two jobs were started on one root by mistake: stop one,
    or give it its own root. A restarted incarnation of the same job (same ``job_id=``,
    ``TORCHELASTIC_RUN_ID`` or Slurm job) takes the lease over without this error.
    """


class LeaseLostError(LeaseError):
    """This job's lease was taken over (it stalled past the TTL): it must not write any more.

    Raised by any writing call once another job took the root. The message says whether the current
    save was committed. End this job; the job that took the root continues.
    """


class StepExistsError(CheckpointError):
    """The step is already committed; committed checkpoints are never modified without overwrite=True.

    Raised by ``save``. Pass ``overwrite=True`` to replace the step atomically, or save another step.
    """


class StepNotFoundError(CheckpointError):
    """The step asked for is not a committed checkpoint of this root.

    Raised by ``load(step=N)``, ``load(tag=...)``, ``read(step=N)``, ``tag``, ``delete``, ``DCPReader``
    and ``export`` for a step or tag the root does not hold. ``ck.steps()``, ``ck.tags()`` or
    ``ckptguard ls ROOT`` lists what it holds.
    """


class StepRetiredError(StepNotFoundError):
    """The step asked for was retired (retention of a writing job) while this job was reading it.

    Not a corruption: the checkpoint was intact and is gone. ``load(step=None)``
    never raises it (it lists the root again and loads the newest).
    """


class PathCollisionError(CheckpointError):
    """Two ranks name the same or nested ``files=`` paths: they would overwrite each other.

    Also raised for a ``files=`` path that is, contains or lies inside the checkpoint root, and by
    ``save_file`` for a lock path that is not a regular file. Raised before anything is written; the
    message names the ranks and paths. Give each rank its own path.
    """


class ReplicatedValueError(CheckpointError):
    """A plain value, which is stored once for all ranks, differs between ranks: wrap it in PerRank.

    Raised by ``save`` before anything is committed, naming the key and the ranks that differ.
    """


class StorageError(CheckpointError):
    """The storage refused or failed an operation.

    The message names the file or object and the rank; the subclasses name the common causes.
    """


class CommitOutcomeUnknownError(StorageError):
    """A commit request got no answer (the reply was lost, the endpoint stopped answering) and asking
    again got none either: the step may or may not be committed. Its data is kept; the next save or
    the next job to take the root settles it (adopts it if its commit landed, else aborts it)."""


class DiskFullError(StorageError):
    """No space left (or quota exceeded) on the storage.

    Raised by ``save`` and ``save_file``, naming the root, the bytes needed and free. Nothing of the
    save was committed; free space (or lower ``keep_last``) and save again.
    """


class StoragePermissionError(StorageError):
    """The job's user may not write there, or the filesystem is read-only.

    Make the root writable by the user the job runs as, on every node (for S3: the credentials' policy).
    """


class StaleHandleError(StorageError):
    """ESTALE persisted through retries: another node renamed or removed what this one holds.

    Check that only one job writes to the root, and the NFS mount options (``lookupcache``, ``actimeo``).
    """


class NotVisibleError(StorageError):
    """A file another rank wrote did not become visible here in time (failed writer or stale cache).

    Raised by ``save``'s commit check before anything is committed, naming what is missing. Raise
    ``visibility_timeout_s`` for shared filesystems whose caches are slow to show new files.
    """


class BucketNotFoundError(StorageError):
    """The object store has no bucket of that name (at that endpoint).

    Check the bucket name and the endpoint (``AWS_ENDPOINT_URL``, ``storage_options={"endpoint_url": ...}``).
    """


class WrongRegionError(StorageError):
    """The bucket lives in another region than the one the client was configured for.

    Set ``AWS_REGION`` or ``storage_options={"region_name": ...}`` to the bucket's region (named in the
    message).
    """


class UnsupportedStorageError(StorageError, ValueError):
    """A root or path URL whose scheme has no storage backend, or a store ckptguard cannot use safely
    (an S3-compatible store that ignores conditional writes)."""


class UnsafeObjectError(CheckpointError):
    """Loading this object would run code from the checkpoint (unrestricted unpickling): refused.

    Raised by loads and ``import`` for a stored object or a DCP ``.metadata`` that names a class outside
    the allowed ones. Only load such a file with ``torch.load(weights_only=False)`` if you trust it.
    """


class UnsupportedValueError(CheckpointError, TypeError):
    """A value ``save`` was given that no load could give back equal (it would need unpickling code,
    or would come back as another type): refused before anything is written."""


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument's value is refused (a NaN or infinity in ``metadata=``, nesting too deep, a negative
    step): a ValueError that crosses ranks as itself, so every rank raises the same error."""


class TemplateMismatchError(CheckpointError, ValueError):
    """The state given to ``load`` does not fit the checkpoint (a shape differs, a key is missing):
    found when the load is planned, before any byte is read."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose bytes do not match its manifest (bit rot, truncation, deletion).

    Raised by ``load(step=N)``, ``read``, ``load_file``, ``DCPReader`` and ``export``, naming the file and
    what is wrong. ``load()`` without a step falls back to the checkpoint committed before, with a
    warning. ``ckptguard verify ROOT`` reports every damaged file.
    """


class MalformedRecordError(CorruptCheckpointError):
    """A record read from storage or an imported file (a manifest, ``latest``, a tag, the lease, the S3
    index, a safetensors header, DCP's ``.metadata``) is too large, nests too deep, or does not fit its
    schema. ``field`` names what is wrong (``(size)``, ``(nesting)``, ``(record)`` or a field path)."""

    def __init__(
        self, message: str, *, rank: int | None = None, path: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(message, rank=rank, path=path)
        self.field = field


class TornLoadError(CheckpointError):
    """A load verified every byte, then read different bytes (or fewer: a file cut short) when it read
    them again into place: a file of the committed checkpoint was modified in place during the load
    (never by ckptguard). The state being loaded may hold part of it, so no older step is tried: load
    again, after finding what modifies the checkpoint's files."""


class PeerError(CheckpointError):
    """Another rank failed with an error that is not a CheckpointError (its type is named in the message)."""


def _rebuild(cls: type[CheckpointError], message: str, rank: int | None, path: str | None) -> CheckpointError:
    return cls(message, rank=rank, path=path)


def _subclasses(cls: type[CheckpointError]) -> dict[str, type[CheckpointError]]:
    out = {cls.__name__: cls}
    for sub in cls.__subclasses__():
        out.update(_subclasses(sub))
    return out


@dataclass(frozen=True)
class FailureRecord:
    """What crosses ranks when a rank fails a collective step: enough to rebuild the error there."""

    rank: int | None
    host: str
    kind: str  # the exception's class name
    message: str
    path: str | None
    at: float  # wall-clock time of the failure (the earliest is the likeliest cause)
    interrupted: bool = False  # a KeyboardInterrupt / SystemExit (BaseException, not Exception)
    decision: bool = False  # a refusal decided by rank 0 from everyone's reports, not one rank's failure

    @property
    def error_class(self) -> type[CheckpointError]:
        """The CheckpointError subclass to raise on ranks that did not fail themselves."""
        return _subclasses(CheckpointError).get(self.kind, PeerError)

    def describe(self) -> str:
        known = self.kind in _subclasses(CheckpointError)
        return self.message if known else f"{self.kind}: {self.message}"


def from_os_error(
    err: OSError, path: str, rank: int | None = None, *, needed_bytes: int | None = None, root: str | None = None
) -> CheckpointError:
    """The one translation of an OSError into a typed error with a message that says what to do."""
    who = f"rank {rank}" if rank is not None else "this process"
    where = getattr(err, "filename", None) or path
    where = os.fsdecode(where) if isinstance(where, bytes) else str(where)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        target = root or path
        free = _free_bytes(target)
        need = f"{who} needed {needed_bytes:,} bytes for its part" if needed_bytes is not None else f"{who} ran out"
        have = f", {free:,} bytes are free" if free is not None else ""
        kind = "quota exceeded" if err.errno == errno.EDQUOT else "disk full"
        return DiskFullError(
            f"{kind} on {target} while writing {where}: {need}{have}. Free space (or lower keep_last) "
            "and save again; nothing of this save was committed.",
            rank=rank,
            path=where,
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "the filesystem is read-only" if err.errno == errno.EROFS else "permission denied"
        return StoragePermissionError(
            f"{why}: {who} (uid {os.getuid()}) cannot write {where}. Make the checkpoint root writable "
            "by the user the training job runs as, on every node.",
            rank=rank,
            path=where,
        )
    if err.errno == errno.ESTALE:
        return StaleHandleError(
            f"stale file handle (ESTALE) on {where}: another node renamed or removed it and this node's "
            "NFS client still holds the old handle. Check that only one job writes to this checkpoint "
            "root, and the NFS mount options (lookupcache, actimeo).",
            rank=rank,
            path=where,
        )
    return StorageError(f"{who} failed on {where}: {type(err).__name__}: {err}", rank=rank, path=where)


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
