"""What an object-store root can drop: attempts no index entry names and the multipart uploads left open
under its staging prefix, retired checkpoints, the data of failed saves that can never commit.

A listing finds the candidates; the index, read after the listing, decides: a stale
listing can only hide garbage, never offer a committed checkpoint's data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from ckptguard.errors import CheckpointError
from ckptguard.protocol import layout
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.objindex import Index, IndexEntry
from ckptguard.protocol.rootkit import relative
from ckptguard.storage import StorageBackend
from ckptguard.storage.base import ObjectStore

if TYPE_CHECKING:
    from ckptguard.protocol.objstore import ObjectStoreRoot

log = logging.getLogger("ckptguard")


def staging_garbage(
    storage: StorageBackend,
    live_attempts: Callable[[], set[str]],
    keep_attempts: frozenset[str],
    guard: Callable[[str], None],
) -> list[str]:
    """The attempt prefixes to remove; uploads left open inside attempts kept are aborted here.

    ``live_attempts()`` (the attempts the index names, not aborted) is called after the listing;
    ``guard(acting)`` raises once this job no longer holds the root, and runs before any abort.
    """
    staging_root = storage.path(layout.STAGING)
    candidates = set(storage.listdir(staging_root))
    store = _as_object_store(storage)
    uploads = store.uploads_in_progress(staging_root) if store is not None else []
    for upload_path, _ in uploads:
        candidates.add(_attempt_dir(upload_path, staging_root))
    live = live_attempts() | set(keep_attempts)
    staging = []
    for entry in sorted(candidates):
        parsed = layout.parse_staging(entry)
        if parsed is None or parsed[1] not in live:
            staging.append(storage.path(layout.STAGING, entry))
    # Uploads left open inside live attempts (a retried completion, a killed writer): abort them too.
    # A committed attempt's objects are complete; the current attempt has completed before this runs.
    if store is not None and uploads:
        guard("abort multipart uploads left open")
        for upload_path, upload_id in uploads:
            parsed = layout.parse_staging(_attempt_dir(upload_path, staging_root))
            if parsed is not None and parsed[1] in live and parsed[1] not in keep_attempts:
                store.abort_upload(upload_path, upload_id)
    return staging


def _attempt_dir(path: str, staging_root: str) -> str:
    return (relative(path, staging_root) or "").split("/", 1)[0]


def _as_object_store(storage: StorageBackend) -> ObjectStore | None:
    """The backend as an :class:`ObjectStore` where it has multipart uploads to list."""
    return cast("ObjectStore", storage) if storage.leaves_uploads else None


def retire(root: ObjectStoreRoot, path: str) -> str | None:
    """A committed checkpoint: out of the index first, then its commit object; its data prefix is
    returned for removal. Anything else (an attempt's prefix) is returned as is."""
    rel = relative(path, root.path)
    name = CheckpointName.parse(rel) if rel is not None and "/" not in rel else None
    if name is None:
        root.guard(f"retire {path}")
        return path
    removed: list[IndexEntry] = []

    def unindex(index: Index) -> bool:
        removed.clear()
        e = index.find(name)
        if e is None:
            return False
        removed.append(e)
        index.entries.remove(e)
        return True

    commit = root.commit_path(name)
    seen = root.storage.read_versioned(commit)
    root.update_index(unindex, f"retire {name.dirname}")
    if not removed:
        return None
    if seen is not None and _commit_attempt_in(root, name, seen[0]) == removed[0].attempt:
        # Only the very commit object read: a new save of this step version (its key is free once
        # the entry is gone) keeps its own.
        root.guard(f"delete {commit}")
        root.storage.delete_if_version(commit, seen[1])
    return root.staging_dir(name.step, removed[0].attempt)


def _commit_attempt_in(root: ObjectStoreRoot, name: CheckpointName, data: bytes) -> str | None:
    try:
        return root.parse_manifest(name, data).attempt
    except CheckpointError:
        return None


def discard_attempt(root: ObjectStoreRoot, staging: str, name: CheckpointName, attempt: str) -> None:
    """Remove the data of a save that failed, unless it may be committed after all: an attempt the
    index records as pending is settled first (adopted if its commit object is ours, else aborted by a
    tombstone), and only an attempt that can never commit loses its data."""
    root.guard(f"discard the attempt {staging}")
    state: list[str] = []

    def settle(index: Index) -> bool:
        state.clear()
        e = index.find(name)
        if e is None or e.attempt != attempt:
            return False  # never recorded: its commit object was never created
        if e.state == "pending":
            root.settle(e, index)
        state.append(e.state)
        return True

    root.update_index(settle, f"settle the failed attempt {attempt} of {name.dirname}")
    if state and state[0] == "committed":
        log.warning("ckptguard: %s (attempt %s) is committed after all: its data is kept", name.dirname, attempt)
        return
    root.remove_retired(staging)
