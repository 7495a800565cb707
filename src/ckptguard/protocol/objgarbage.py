"""What an object-store root can drop from its staging prefix: attempts no index entry names, and the
multipart uploads left open under it.

A listing finds the candidates; the index, read after the listing, decides: a stale
listing can only hide garbage, never offer a committed checkpoint's data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from ckptguard.protocol import layout
from ckptguard.protocol.rootkit import relative
from ckptguard.storage import StorageBackend
from ckptguard.storage.base import ObjectStore


def staging_garbage(storage: StorageBackend, live_attempts: Callable[[], set[str]], keep_attempts: frozenset[str],
                    guard: Callable[[str], None]) -> list[str]:
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
