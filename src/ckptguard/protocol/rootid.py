"""The root's identity: a random id created once and never replaced.

    .ckptguard/root-id     32 hex digits and a newline

Integrations bind their pointer files to it (a pointer copied into another run's directory names
another identity, and is refused there). It is created like every control record: by one
compare-and-swap round that creates it only if it is absent (the link of a synced temp file on a
filesystem, a conditional PUT on an object store), with the fence run right before it becomes
visible, so a job that lost the root creates none. Two jobs creating it at once end with one
identity: the second one's create fails, and it reads and returns the first one's.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from ckptguard.errors import CorruptCheckpointError
from ckptguard.protocol import layout
from ckptguard.protocol.cas import Keep, Put, swap
from ckptguard.storage import StorageBackend

_ID = re.compile(r"[0-9a-f]{32}")
#: The record is 33 bytes; a longer one was written by something else.
_MAX_BYTES = 64


def record_path(storage: StorageBackend) -> str:
    return storage.path(layout.ROOT_ID)


def read(storage: StorageBackend) -> str | None:
    """The identity of the root ``storage`` is opened on, or None if it has none yet.

    Raises:
        CorruptCheckpointError: the record cannot be read or does not hold an identity.
    """
    path = record_path(storage)
    try:
        data = storage.read_bytes(path, _MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptCheckpointError(f"{path} cannot be read ({e}): the root's identity is unknown", path=path) from e
    return _decode(data, path)


def create(storage: StorageBackend, fence: Callable[[], None]) -> str:
    """The root's identity, created if it has none; ``fence`` raises (LeaseLostError) once this job no
    longer holds the root, and runs right before a new record becomes visible.

    Raises:
        CorruptCheckpointError: the record there does not hold an identity.
        LeaseLostError: this job lost the root before its record landed (nothing was created).
    """
    path = record_path(storage)
    new = uuid.uuid4().hex

    def decide(current: str | None) -> Keep[str] | Put[str, str]:
        return Keep(current) if current is not None else Put(new, new)

    storage.makedirs(storage.path(layout.CONTROL))
    made: str = swap(
        storage,
        path,
        decode=lambda data: _decode(data, path),
        encode=lambda ident: ident.encode() + b"\n",
        decide=decide,
        fence=fence,
        what="create the root's identity",
    )
    return made


def _decode(data: bytes, path: str) -> str:
    ident = data.strip().decode("ascii", "replace")
    if len(data) > 33 or not _ID.fullmatch(ident):
        raise CorruptCheckpointError(
            f"{path} does not hold a root identity (32 hex digits): the file was modified", path=path
        )
    return ident


__all__ = ["create", "read", "record_path"]
