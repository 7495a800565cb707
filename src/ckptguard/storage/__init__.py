"""Storage backends: the few primitives the commit protocol needs, behind one protocol.

:func:`open_storage` maps a root (a directory or a URL) to its backend; a scheme
without a backend is refused with an error naming the schemes supported, never
taken for a local directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from ckptguard.errors import UnsupportedStorageError
from ckptguard.storage.base import ObjectStore, ReadHandle, StorageBackend, WriteStream
from ckptguard.storage.posix import PosixStorage

__all__ = ["ObjectStore", "PosixStorage", "ReadHandle", "StorageBackend", "WriteStream", "is_s3_url", "local_path",
           "open_storage"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
SUPPORTED = "local paths, file:// URLs and s3:// URLs (S3 and S3-compatible stores)"


def is_s3_url(root: str | os.PathLike[str]) -> bool:
    m = _URL.match(os.fspath(root))
    return m is not None and m.group(1).lower() == "s3"


def local_path(root: str | os.PathLike[str]) -> str:
    """``root`` as a local filesystem path; a URL of any other scheme is refused."""
    text = os.fspath(root)
    m = _URL.match(text)
    if m is None:
        return text
    if m.group(1).lower() == "file":
        return m.group(2) or "/"
    if m.group(1).lower() == "s3":
        raise UnsupportedStorageError(f"{text} is an object store URL; this operation needs a local path",
                                      path=text)
    raise UnsupportedStorageError(
        f"{text}: no storage backend for {m.group(1)}:// URLs in this ckptguard (supported: {SUPPORTED}). "
        "It was not treated as a local directory.", path=text)


def open_storage(root: str | os.PathLike[str], options: Mapping[str, Any] | None = None) -> StorageBackend:
    """The storage backend for a checkpoint root given as a directory or a URL.

    ``options`` configure an object store (for ``s3://``: ``endpoint_url``,
    ``region_name``, ``part_size``... see :class:`ckptguard.storage.s3.S3Options`).
    """
    text = os.fspath(root)
    if is_s3_url(text):
        try:
            from ckptguard.storage.s3 import S3Storage
        except ImportError as e:  # boto3 is an extra
            raise UnsupportedStorageError(
                f"{text}: s3:// roots need boto3: pip install 'ckptguard[s3]' ({e})", path=text) from e
        return S3Storage("s3://" + text[5:], dict(options) if options else None)
    path = local_path(text)
    if options:
        raise ValueError(f"storage_options {sorted(options)} apply to object stores, not to the local path {path}")
    return PosixStorage(path)
