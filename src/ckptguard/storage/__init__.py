"""Storage backends: the few primitives the commit protocol needs, behind one protocol.

:func:`open_storage` maps a root (a directory or a URL) to its backend; a scheme
without a backend is refused with an error naming the schemes supported, never
taken for a local directory.
"""

from __future__ import annotations

import os
import re

from ckptguard.errors import UnsupportedStorageError
from ckptguard.storage.base import ReadHandle, StorageBackend, WriteStream
from ckptguard.storage.posix import PosixStorage

__all__ = ["PosixStorage", "ReadHandle", "StorageBackend", "WriteStream", "local_path", "open_storage"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
SUPPORTED = "local paths and file:// URLs"


def local_path(root: str | os.PathLike[str]) -> str:
    """``root`` as a local filesystem path; a URL of any other scheme is refused."""
    text = os.fspath(root)
    m = _URL.match(text)
    if m is None:
        return text
    if m.group(1).lower() == "file":
        return m.group(2) or "/"
    raise UnsupportedStorageError(
        f"{text}: no storage backend for {m.group(1)}:// URLs in this ckptguard (supported: {SUPPORTED}). "
        "It was not treated as a local directory.", path=text)


def open_storage(root: str | os.PathLike[str]) -> StorageBackend:
    """The storage backend for a checkpoint root given as a directory or a URL."""
    return PosixStorage(local_path(root))
