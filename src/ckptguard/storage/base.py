"""What the commit protocol needs from a storage backend, on POSIX and object stores alike.

A backend is a namespace of opaque path strings under one root (built with
:meth:`StorageBackend.path` and ``posixpath.join``). The protocol asks for few
operations, each with a guarantee it relies on:

- **exclusive create** of a small object: exactly one of several writers wins;
- **publish without replace**: an attempt becomes a checkpoint atomically, and
  never over an existing one;
- **compare-and-swap** of a small object on a version token read earlier (the
  lease, the `latest` pointer): a stale writer cannot overwrite a newer state;
  **compare-and-delete** likewise (releasing the lease);
- **streamed data writes** into new files, made durable by ``sync()``;
- **ranged reads** into caller buffers, of regular files only;
- listing, deletion and directory sync where they mean something.

Everything a backend raises is an ``OSError`` (``FileExistsError``,
``FileNotFoundError``...) or a :class:`~ckptguard.errors.CheckpointError`; the
protocol turns OSErrors into typed errors in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

#: Small control objects (manifests, the lease, `latest`) are read whole; larger is refused.
MAX_SMALL_OBJECT_BYTES = 1 << 30


class WriteStream(Protocol):
    """A new data file being written, in order."""

    path: str

    def write(self, views: Sequence[memoryview], stable: bool = False) -> None:
        """Append every byte of ``views`` (a partial write is retried, never dropped).

        ``stable``: the caller keeps these bytes alive and unchanged until ``sync`` (or ``close``)
        returns, so a backend that sends data later may send it from there instead of copying it;
        otherwise the caller may reuse its buffers as soon as ``write`` returns."""

    def sync(self) -> None:
        """Make everything written so far durable."""

    def close(self) -> None:
        """Release the file (after ``sync``: it stays; a backend may drop an unsynced one)."""


class ReadHandle(Protocol):
    """An open regular file, read by ranges."""

    path: str

    def size(self) -> int: ...

    def read_into(self, views: Sequence[memoryview], offset: int) -> None:
        """Fill ``views`` from ``offset`` on; a file that ends early is a CorruptCheckpointError."""

    def close(self) -> None: ...


class StorageBackend(Protocol):
    """One checkpoint root as this rank sees it."""

    #: the root as the user gave it: a directory or a URL
    root: str
    #: whether an open :class:`ReadHandle` keeps reading the bytes it opened after the file is renamed or
    #: unlinked (POSIX: an open descriptor does), so that a second pass over a file may reuse the handle
    #: instead of holding the bytes in memory or spilling them to local disk
    keeps_open_files: bool
    #: whether a read split into many small ones costs no more than one large one (POSIX: each is a
    #: syscall served by the page cache or the disk's read-ahead), so that a load may read and hash in
    #: pieces that stay in the CPU's cache; False where every read is a request (an object store's GET)
    cheap_small_reads: bool
    #: whether listing a directory is cheap (local metadata) rather than a request per page to a remote
    #: service: how far a search through a user's directories may go
    cheap_listing: bool
    #: whether writes can leave uploads that are neither completed nor aborted (S3's multipart uploads),
    #: to be listed and aborted by garbage collection: then it is an :class:`ObjectStore`
    leaves_uploads: bool
    #: whether a write that has returned is visible, whole, to every reader at once (S3's strong
    #: read-after-write consistency): then a writer's completed write is the proof that its file is there;
    #: False where another node may see it later (NFS caches attributes): the leader waits to see them all
    visible_once_written: bool

    def path(self, *parts: str) -> str:
        """The path of ``parts`` under the root."""

    def join(self, directory: str, name: str) -> str:
        """The path of entry ``name`` of ``directory`` (any directory, not only under the root)."""

    def parent(self, path: str) -> str:
        """The directory holding ``path``."""

    def is_dir(self, path: str, follow_links: bool = True) -> bool:
        """Whether ``path`` is a directory that may hold entries (``follow_links=False``: itself one, not a
        link to one; a FIFO or a file never is). A store without directories answers True for any name:
        a listing tells whether it holds anything."""

    # -- namespace ---------------------------------------------------------------
    def makedirs(self, path: str, within: str | None = None) -> None:
        """Create ``path`` and its missing parents, but none at or above ``within`` if given (which
        must exist: FileNotFoundError if it is gone)."""

    def make_dir_durable(self, path: str) -> None:
        """Create ``path`` (which must not exist) and make its entry durable in its parent."""

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path`` ([] where there is nothing)."""

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int | None:
        """The size of a regular file, or None where there is none."""

    def mtime(self, path: str) -> float | None: ...

    def remove_tree(self, path: str) -> None: ...

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` (creates, renames, unlinks) durable."""

    # -- small objects -------------------------------------------------------------
    def read_bytes(self, path: str, limit: int = MAX_SMALL_OBJECT_BYTES) -> bytes:
        """A regular file's content (no symlinks, no FIFOs; over ``limit`` bytes is refused)."""

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        """Content and a version token for :meth:`compare_and_swap`, or None if absent."""

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` only if it does not exist; True if this call created it."""

    def replace(self, path: str, data: bytes | Sequence[bytes]) -> None:
        """Replace ``path`` with ``data`` atomically and durably (readers see old or new). ``data``: the
        content, or its parts in order, written one after another (a manifest's tables are tens of MB
        at thousands of ranks: joining them would copy them)."""

    def compare_and_swap(
        self, path: str, data: bytes, token: str | None, fence: Callable[[], None] | None = None
    ) -> bool:
        """Replace ``path`` with ``data`` only if its version is still ``token`` (None: only if absent).

        ``fence`` (raises when this job no longer holds the root) runs after the new content is
        staged and immediately before the step that makes it visible: a job that stalls while it
        stages (an fsync) and is taken over meanwhile writes nothing."""

    def delete(self, path: str) -> None:
        """Remove one object; absent is fine."""

    def delete_if_version(self, path: str, token: str, fence: Callable[[], None] | None = None) -> bool:
        """Remove ``path`` only if its version is still ``token``; True if this call removed it.
        ``fence`` runs immediately before the removal (as for :meth:`compare_and_swap`)."""

    def publish(self, src: str, dst: str) -> None:
        """Make directory ``src`` appear as ``dst`` atomically; FileExistsError if ``dst`` exists."""

    # -- data ---------------------------------------------------------------------
    def open_new(self, path: str) -> WriteStream:
        """A new file (FileExistsError if it exists: one writer per path)."""

    def open_read(self, path: str) -> ReadHandle: ...

    def wait_visible(
        self, path: str, size: int | None = None, timeout: float = 30.0, stop_if: Callable[[], None] | None = None
    ) -> None:
        """Wait until ``path`` is visible here (with ``size`` bytes if given); NotVisibleError if not.
        ``stop_if`` runs between looks and raises to stop waiting (a path that will never come)."""

    def sizes_in(self, directory: str) -> dict[str, int]:
        """Name -> size of the files directly in ``directory``, as this rank sees them now."""

    def prefetch(self, directory: str, prefix: str) -> Callable[[], None]:
        """Start warming a cache with the files under ``directory`` named ``prefix...`` (a hint);
        returns a function that stops it."""


class ObjectStore(StorageBackend, Protocol):
    """A backend without directories or rename (an object store): what else it offers."""

    def uploads_in_progress(self, path: str) -> list[tuple[str, str]]:
        """(path, upload id) of the multipart uploads neither completed nor aborted under ``path``."""

    def abort_upload(self, path: str, upload_id: str) -> None: ...
