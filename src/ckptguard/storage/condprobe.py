"""The probe of conditional writes for an object-store backend that does not check its own: exclusive
create and compare-and-swap on a throwaway key, once per process and root, before a job writes.

The commit protocol on object stores rests on those two conditions (one commit object per step, one
winner of each index swap); a store that ignores them would let two writers both win and lose a commit,
so it is refused (:class:`UnsupportedStorageError`) instead of used unsafely. S3 probes itself (per
endpoint and bucket, with the multipart completion too: ``storage/s3/probe.py``).
"""

from __future__ import annotations

import contextlib
import threading
import uuid

from ckptguard.errors import UnsupportedStorageError
from ckptguard.storage.base import StorageBackend

_checked: set[str] = set()
_lock = threading.Lock()


def check_conditional_writes(storage: StorageBackend, probe_dir: str) -> None:
    """Refuse ``storage`` unless exclusive create and compare-and-swap refuse a second and a stale writer
    (the probe object is written under ``probe_dir`` and removed)."""
    with _lock:
        if storage.root in _checked:
            return
    path = storage.join(probe_dir, f"conditional-{uuid.uuid4().hex}")
    failures: list[str] = []
    storage.makedirs(probe_dir)
    try:
        if not storage.create_exclusive(path, b"first"):
            failures.append("an exclusive create of a new key was refused")
        elif storage.create_exclusive(path, b"second") or storage.read_bytes(path) != b"first":
            failures.append("an exclusive create over an existing key succeeded (If-None-Match ignored)")
        versioned = storage.read_versioned(path)
        if versioned is not None:
            _, stale = versioned
            if not storage.compare_and_swap(path, b"third", stale):
                failures.append("a compare-and-swap on the current version was refused")
            elif storage.compare_and_swap(path, b"fourth", stale) or storage.read_bytes(path) != b"third":
                failures.append("a compare-and-swap on a replaced version succeeded (If-Match ignored)")
    finally:
        with contextlib.suppress(OSError):
            storage.delete(path)
    if failures:
        raise UnsupportedStorageError(
            f"{storage.root} does not honour conditional writes: {'; '.join(failures)}. Two writers could both "
            "commit one step; ckptguard refuses to write there (nothing was written; the probe object was removed).",
            path=path,
        )
    with _lock:
        _checked.add(storage.root)
