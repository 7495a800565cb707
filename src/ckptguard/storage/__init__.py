"""Storage backends: the few primitives the commit protocol needs, behind one protocol.

:func:`open_storage` maps a root (a directory or a URL) to its backend. Schemes are
case-insensitive (RFC 3986: ``S3://`` is ``s3://``). A scheme without a backend, and a
URL-like root that is malformed (``s3:/bucket``, ``s3:bucket``), are refused with an
error naming what was probably meant, never taken for a local directory: a typo must
not create ``./s3:/bucket`` and write checkpoints there.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from typing import Any

from ckptguard.errors import UnsupportedStorageError
from ckptguard.storage.base import ObjectStore, ReadHandle, StorageBackend, WriteStream
from ckptguard.storage.posix import PosixStorage

__all__ = ["ObjectStore", "PosixStorage", "ReadHandle", "StorageBackend", "WriteStream", "is_s3_url", "local_path",
           "open_storage", "require_s3_extra"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
SUPPORTED = "local paths, file:// URLs and s3:// URLs (S3 and S3-compatible stores)"
# "name:" as a path's first component, not followed by "//": a URL with its slashes lost. Only
# well-known URL schemes count, so that an ordinary directory such as "run:3" stays a directory.
_MALFORMED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)/*(.*)$", re.DOTALL)
_KNOWN_SCHEMES = frozenset({"s3", "file", "gs", "gcs", "az", "abfs", "abfss", "adl", "wasb", "wasbs", "hf",
                            "hdfs", "http", "https", "ftp", "sftp", "ssh", "oss", "cos", "r2", "swift"})
S3_EXTRA = "pip install 'ckptguard[s3]'"


def is_s3_url(root: str | os.PathLike[str]) -> bool:
    m = _URL.match(os.fspath(root))
    return m is not None and m.group(1).lower() == "s3"


def _refuse_malformed(text: str) -> None:
    m = _MALFORMED.match(text)
    if m is None or m.group(1).lower() not in _KNOWN_SCHEMES:
        return
    scheme, rest = m.group(1).lower(), m.group(2)
    meant = f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
    raise UnsupportedStorageError(
        f"{text} looks like a {scheme}:// URL with its slashes lost; did you mean {meant}? "
        f"(nothing was created; a local directory whose name starts with '{m.group(1)}:' can be given as "
        f"./{text})", path=text)


def require_s3_extra(text: str) -> None:
    """Raise the error that names the install line when the ``[s3]`` extra is missing."""
    try:
        importlib.import_module("boto3")
        importlib.import_module("botocore.exceptions")
    except ImportError as e:
        raise UnsupportedStorageError(
            f"{text}: s3:// roots need the optional S3 dependencies (boto3, botocore), which are not "
            f"installed: {S3_EXTRA}  ({e})", path=text) from None


def local_path(root: str | os.PathLike[str]) -> str:
    """``root`` as a local filesystem path; a URL of any other scheme, or a malformed one, is refused."""
    text = os.fspath(root)
    m = _URL.match(text)
    if m is None:
        _refuse_malformed(text)
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
        require_s3_extra(text)  # boto3 is an extra; ckptguard.storage.s3 imports it only when used
        from ckptguard.storage.s3 import S3Storage

        return S3Storage("s3://" + text[5:], dict(options) if options else None)
    path = local_path(text)
    if options:
        raise ValueError(f"storage_options {sorted(options)} apply to object stores, not to the local path {path}")
    return PosixStorage(path)
